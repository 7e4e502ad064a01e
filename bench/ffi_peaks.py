"""Multiply-add peaks and the compute roofline of the CPU attention kernels (shared by the benchmarks).

``bench/ffi_compute.cc`` is built with the kernel sources and the compiler flags of one
instruction-set level (as ``ffi/CMakeLists.txt`` compiles that level) and measures, on one thread
and in the thread's CPU time, the multiply-add rate of each kind of product the kernels can use:

* ``float32``: fused multiply-adds of the level's vector width;
* ``int16``, ``int8``: integer pair products with the adds that accumulate them (``vpmaddwd`` +
  ``vpaddd``; ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``), what a level without VNNI would use;
* ``vnni16``, ``vnni8``: ``vpdpwssd``, ``vpdpbusd`` (levels with AVX-512 VNNI);
* ``int8x2``: the multiply-adds of the kernels' ``int8x2`` arithmetic, half the ``vnni8`` rate
  (each is two byte products: the 15-bit query is split into two bytes).

The compute ceiling of a profile is what the kernel could stream if memory were free and its
products ran at those peaks: decode attention needs ``G * D`` multiply-adds for the scores and
``G * D`` for the value sums per key and KV head (GQA group G, head dim D, one query position),
each at the peak of the arithmetic the kernel uses for it (``ninfer_kv.ops.ffi.handlers.arithmetic``), so

    ceiling = cores * K/V bytes per key-head / (G * D / peak_scores + G * D / peak_values)

and the roofline is ``min(copy bandwidth, ceiling)``.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "ffi" / "src"
# Compiler flags of the levels ffi_compute.cc can measure, as ffi/CMakeLists.txt (the vector
# levels: its peak loops need AVX registers).
LEVEL_FLAGS = {
    "avx2": ["-march=x86-64-v3", "-mtune=generic"],
    "avx512": ["-march=x86-64-v4", "-mtune=generic"],
    "avx512vnni": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi", "-mtune=generic"],
    "native": ["-march=native"],
}
# The peak each arithmetic of ninfer_kv.ops.ffi.handlers.ARITHMETIC_NAMES runs at.
ARITHMETIC_PEAK = {"float32": "float32", "int8x2": "int8x2"}
PEAK_KINDS = {
    "avx2": ("float32", "int16", "int8"),
    "avx512": ("float32", "int16", "int8"),
    "avx512vnni": ("float32", "int16", "int8", "vnni16", "vnni8", "int8x2"),
    "native": ("float32", "int16", "int8"),
}


def measurable(level: str) -> bool:
    """Whether ffi_compute.cc can be built for ``level`` here (an x86-64 vector level and a compiler)."""
    return level in LEVEL_FLAGS and platform.machine() in ("x86_64", "AMD64") and compiler() is not None


def compiler() -> str | None:
    """The C++ compiler the benchmarks build with (``$CXX``, else g++ or c++)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(level: str, out_dir: Path) -> Path:
    """ffi_compute.cc with the kernel sources, compiled for ``level``; returns the executable."""
    exe = Path(out_dir) / f"ffi_compute_{level}"
    cmd = [
        compiler(), "-std=gnu++17", "-O3", "-fno-math-errno", "-ffp-contract=fast", *LEVEL_FLAGS[level],
        f"-DNINFER_KV_ISA_ID={level}", f"-I{SRC}", str(REPO / "bench" / "ffi_compute.cc"),
        str(SRC / "attention_core.cc"), str(SRC / "dequantize.cc"), "-o", str(exe),
    ]
    subprocess.run(cmd, check=True)
    return exe


def one_peak(exe: Path, kind: str) -> float:
    """Multiply-adds (lanes) per second of one thread through products of ``kind``."""
    out = subprocess.run([str(exe), "peak", kind], capture_output=True, text=True, check=True).stdout
    return float(out)


@dataclass(frozen=True)
class Peaks:
    """Multiply-add peaks of one level measured in this run: per thread, and all threads at once."""

    level: str
    one: dict[str, float]
    """kind -> multiply-adds per second of one thread running alone."""
    all: dict[str, float]
    """kind -> multiply-adds per second of ``threads`` threads running together (summed)."""
    threads: int


def measure_peaks(level: str, threads: int, kinds: tuple[str, ...] | None = None) -> Peaks:
    """Builds ffi_compute for ``level`` and measures its peaks on one thread and on ``threads``
    concurrent threads (separate processes, each timing its own CPU time), best of two rounds."""
    kinds = kinds or PEAK_KINDS[level]
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(level, Path(tmp))
        one, together = {}, {}
        for kind in kinds:
            one[kind] = max(one_peak(exe, kind) for _ in range(2))
            best = 0.0
            for _ in range(2):
                with ThreadPoolExecutor(max_workers=threads) as pool:
                    best = max(best, sum(pool.map(lambda _i: one_peak(exe, kind), range(threads))))
            together[kind] = best
    return Peaks(level, one, together, threads)


def bytes_per_key_head(profile: str, head_dim: int) -> int:
    """K/V bytes (codes and scales) of one key of one KV head."""
    from ninfer_kv.schema.profiles import KVProfile

    return KVProfile(profile).token_head_bytes(head_dim)


def key_head_seconds(scores_peak: float, values_peak: float, group: int, head_dim: int) -> float:
    """Seconds per key and KV head at the peaks: the scores' and the value sums' multiply-adds."""
    return group * head_dim / scores_peak + group * head_dim / values_peak


def ceiling(profile: str, head_dim: int, group: int, scores_peak: float, values_peak: float) -> float:
    """Bytes per second the products allow at the given peaks (per second of those peaks' cores)."""
    return bytes_per_key_head(profile, head_dim) / key_head_seconds(scores_peak, values_peak, group, head_dim)
