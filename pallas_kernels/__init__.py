"""Pallas GPU kernels (Triton backend) for ninfer_kv's paged append and paged attention ops."""
