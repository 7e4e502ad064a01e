"""Tests of ninfer_kv's codecs, views and ops front end (a package, so its modules import each other relatively)."""
