"""What a benchmark ran on, measured in the same run (shared by the benchmarks).

* :func:`describe`: one line naming the CPU model and cores, the FFI instruction-set level, the form
  of the packed weight products (AMX or not, and why not), and the read bandwidth measured now;
* :func:`read_bandwidth`: bytes per second of reading a buffer once with the FFI's own vector loads
  on its threads (the memory term of every roofline here);
* :func:`bf16_peak`: the machine's BF16 matrix peak (multiply-adds per second on every FFI thread at
  once) through the instruction the packed products use: TDPBF16PS on AMX tiles, else VDPBF16PS,
  else float32 FMAs (``bench/ffi_compute.cc``, built for the level in use).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np

from ninfer_kv.ops.ffi import products as ffi_products

from ninfer_kv.ops.ffi import handlers as ffi_handlers

__all__ = ["cpu_model", "read_bandwidth", "bf16_peak", "describe"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5, threads: int = 0) -> float:
    """Best bytes/s of reading ``nbytes`` once: the FFI's threads (one slice each; ``threads`` 0: all of
    them) or, with ``threads`` 1, the calling thread alone."""
    buf = np.ones(nbytes // 8, np.uint64)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ffi_handlers._stream_read(buf, threads)
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best


def bf16_peak() -> tuple[str, float] | None:
    """``(instruction, multiply-adds per second)`` of the BF16 matrix peak on all FFI threads, or
    ``None`` where ``ffi_compute.cc`` cannot be built for the level in use (no x86-64 vector level or
    no compiler)."""
    import ffi_peaks

    level = ffi_handlers.info().isa
    if not ffi_peaks.measurable(level):
        return None
    features = ffi_handlers.info().cpu_features
    kind = "amx" if "amx-bf16" in features else "bf16" if "avx512bf16" in features else "float32"
    peaks = ffi_peaks.measure_peaks(level, ffi_handlers.num_threads(), (kind,))
    name = {"amx": "TDPBF16PS", "bf16": "VDPBF16PS", "float32": "float32 FMA"}[kind]
    return name, peaks.all[kind]


def describe(read_bw: float | None = None) -> str:
    """One line: CPU model and cores, FFI level, packed-products form (AMX or not), read bandwidth
    (measured now unless given)."""
    info = ffi_handlers.info()
    kernel = ffi_products.packed_kernel()
    amx = "AMX in use" if kernel.startswith("amx") else f"no AMX ({ffi_products.packed_amx_status()})"
    read_bw = read_bandwidth() if read_bw is None else read_bw
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"{cpu_model()}, {os.cpu_count()} cores, FFI level {info.isa} ({info.threads} threads), "
            f"packed products {kernel}, {amx}, read bandwidth {read_bw / 1e9:.1f} GB/s (measured now), "
            f"load average {load}")
