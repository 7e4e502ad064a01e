"""On-device page copies (defined in :mod:`ninfer_kv.device.page_copy`, the device layer;
re-exported here under their original module)."""

from __future__ import annotations

from .device.page_copy import (
    blended_pages,
    compiled_variants,
    copy_page_columns,
    cpu_float,
    page_axis_of,
    word_dtype,
    write_pages,
    write_pages_donated,
)

__all__ = [
    "copy_page_columns",
    "page_axis_of",
    "compiled_variants",
    "blended_pages",
    "write_pages",
    "write_pages_donated",
    "word_dtype",
    "cpu_float",
]
