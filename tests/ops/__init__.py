"""Tests of ninfer_kv's codecs, views and ops front end (package so helpers import relatively)."""
