"""CPU attention kernel without memory: compute per key, next to the machine's multiply-add peak.

Builds ``bench/ffi_compute.cc`` with the kernel sources and the compiler flags of one instruction-set
level (as ``ffi/CMakeLists.txt`` does) for every level given that this CPU runs, then, per profile,
folds 32768 keys of head dim 128 for one GQA group of ``--rows`` query rows over 8 pages that stay
in L2, on one thread.  Printed per level and profile:

* ns per key: time per key of the task (scores and values of all its query rows);
* of FMA peak: the 2 * rows * 128 multiply-adds per key over the peak measured in the same run (a
  loop of independent fused multiply-adds of the level's vector width, one thread);
* compute ceiling: K/V bytes per key and head / ns per key, the GB/s one core could feed if memory
  cost nothing; compare it with "GB per CPU-second" of ``bench/bench_ffi.py``.

After each level's rows, the integer pair-product peaks of the same width, with the adds that
accumulate them (int16: ``vpmaddwd`` + ``vpaddd``; 8-bit: ``vpmaddubsw`` + ``vpmaddwd`` by one +
``vpaddd``): the multiply rate a reduced-precision kernel (int16 or 8-bit fixed-point queries and
probabilities) could reach instead of the float32 one.

Usage::

    python bench/bench_ffi_compute.py                      # avx2 and avx512 where the CPU has them
    python bench/bench_ffi_compute.py --levels avx2 --rows 4 8
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from ninfer_kv import ffi_ops  # noqa: E402
from ninfer_kv.profiles import KVProfile  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "ffi" / "src"
LEVEL_FLAGS = {  # as ffi/CMakeLists.txt (the vector levels: the peak loop needs AVX registers)
    "avx2": ["-march=x86-64-v3", "-mtune=generic"],
    "avx512": ["-march=x86-64-v4", "-mtune=generic"],
}
# (K codec, V codec) as the FFI library numbers them, taken from the profiles themselves
PROFILES = {p.value: (ffi_ops._CODEC_ID[p.k_codec], ffi_ops._CODEC_ID[p.v_codec]) for p in KVProfile}
HEAD_DIM = 128


def build(level: str, out: Path) -> Path:
    exe = out / f"ffi_compute_{level}"
    cmd = [
        shutil.which("g++") or "c++", "-std=gnu++17", "-O3", "-fno-math-errno", "-ffp-contract=fast",
        *LEVEL_FLAGS[level], f"-DNINFER_KV_ISA_ID={level}", f"-I{SRC}",
        str(REPO / "bench" / "ffi_compute.cc"), str(SRC / "attention_core.cc"), str(SRC / "dequantize.cc"),
        "-o", str(exe),
    ]
    subprocess.run(cmd, check=True)
    return exe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", nargs="+", default=["avx2", "avx512"], choices=sorted(LEVEL_FLAGS))
    p.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    p.add_argument("--rows", type=int, nargs="+", default=[4], help="query rows per task (GQA group size x T)")
    p.add_argument("--repeats", type=int, default=30, help="timed passes over the keys (best is reported)")
    args = p.parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit("this benchmark builds the x86-64 levels; run it on an x86-64 machine")
    supported = set(ffi_ops.info().supported) if ffi_ops.is_available() else {"baseline"}
    levels = [lv for lv in args.levels if lv in supported]
    skipped = [lv for lv in args.levels if lv not in supported]
    print(f"{platform.processor() or platform.machine()}, one thread; levels this CPU runs: {', '.join(levels)}"
          + (f" (skipped: {', '.join(skipped)})" if skipped else ""))
    print(f"decode attention task: head dim {HEAD_DIM}, 32768 keys over 8 pages of 64 tokens (in L2)")
    print()
    print("| level | rows | profile | ns per key | G multiply-add lanes/s | of FMA peak | K/V bytes per key-head "
          "| compute ceiling GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for level in levels:
            exe = build(level, Path(tmp))
            peaks = {kind: float(subprocess.run([str(exe), "peak", kind], capture_output=True, text=True,
                                                check=True).stdout) for kind in ("float32", "int16", "int8")}
            peak = peaks["float32"]
            for rows in args.rows:
                for prof in args.profiles:
                    kc, vc = PROFILES[prof]
                    res = subprocess.run([str(exe), str(kc), str(vc), str(rows), str(args.repeats)],
                                         capture_output=True, text=True, check=True).stdout.split()
                    ns, lanes = float(res[0]), float(res[1])
                    nbytes = KVProfile(prof).token_head_bytes(HEAD_DIM)
                    print(f"| {level} | {rows} | {prof} | {ns:.1f} | {lanes / 1e9:.1f} | {100 * lanes / peak:.0f}% "
                          f"| {nbytes} | {nbytes / ns:.1f} |", flush=True)
            print(f"| {level} | | (peak: {peak / 1e9:.1f} G multiply-add lanes/s) | | | | | |")
            print(f"| {level} | | (integer pair products with their adds: int16 {peaks['int16'] / 1e9:.1f} G, "
                  f"8-bit {peaks['int8'] / 1e9:.1f} G multiply lanes/s) | | | | | |")


if __name__ == "__main__":
    main()
