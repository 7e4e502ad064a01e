"""CPU attention kernel without memory: compute per key, next to the machine's multiply-add peaks.

Builds ``bench/ffi_compute.cc`` with the kernel sources and the compiler flags of one instruction-set
level (as ``ffi/CMakeLists.txt`` does, see ``bench/ffi_peaks.py``) for every level given that this
CPU runs, then, per profile, folds 32768 keys of head dim 128 for one GQA group of ``--rows`` query
rows over 8 pages that stay in L2, on one thread (times are the thread's CPU time).  Printed per
level and profile:

* the arithmetic of the scores and of the value sums (``float32`` or ``int8x2``, see
  ``ninfer_kv.ops.ffi.handlers.ARITHMETIC_NAMES``);
* ns per key: time per key of the task (scores and values of all its query rows);
* of peak: the time the task's multiply-adds take at the peaks of their arithmetic (measured in the
  same run, one thread) over the measured time;
* compute ceiling: K/V bytes per key and head / ns per key, the GB/s one core could feed if memory
  cost nothing; compare it with "GB per CPU-second" of ``bench/bench_ffi.py``.

After each level's rows, the peaks of every product kind measured there (``ffi_peaks.PEAK_KINDS``).

Usage::

    python bench/bench_ffi_compute.py                      # every measurable level this CPU runs
    python bench/bench_ffi_compute.py --levels avx2 --rows 4 8
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tabulate import tabulate  # noqa: E402

import ffi_peaks  # noqa: E402  (bench/ is the script's directory)
from ninfer_kv.ops.ffi import handlers as ffi_handlers  # noqa: E402
from ninfer_kv.schema.profiles import KVProfile  # noqa: E402

# (K codec, V codec) as the FFI library numbers them, taken from the profiles themselves
PROFILES = {p.value: (ffi_handlers._CODEC_ID[p.k_codec], ffi_handlers._CODEC_ID[p.v_codec]) for p in KVProfile}
HEAD_DIM = 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", nargs="+", default=["avx2", "avx512", "avx512vnni"],
                   choices=sorted(ffi_peaks.LEVEL_FLAGS))
    p.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    p.add_argument("--rows", type=int, nargs="+", default=[4], help="query rows per task (GQA group size x T)")
    p.add_argument("--repeats", type=int, default=30, help="timed passes over the keys (best is reported)")
    args = p.parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit("this benchmark builds the x86-64 levels; run it on an x86-64 machine")
    supported = set(ffi_handlers.info().supported) if ffi_handlers.is_available() else {"baseline"}
    levels = [lv for lv in args.levels if lv in supported or lv == "native"]
    skipped = [lv for lv in args.levels if lv not in levels]
    print(f"{platform.processor() or platform.machine()}, one thread (CPU time); levels this CPU runs: "
          f"{', '.join(levels)}" + (f" (skipped: {', '.join(skipped)})" if skipped else ""))
    print(f"decode attention task: head dim {HEAD_DIM}, 32768 keys over 8 pages of 64 tokens (in L2)\n")
    rows_out, peak_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for level in levels:
            exe = ffi_peaks.build(level, Path(tmp))
            peaks = {kind: max(ffi_peaks.one_peak(exe, kind) for _ in range(2)) for kind in ffi_peaks.PEAK_KINDS[level]}
            for rows in args.rows:
                for prof in args.profiles:
                    kc, vc = PROFILES[prof]
                    res = subprocess.run([str(exe), str(kc), str(vc), str(rows), str(args.repeats)],
                                         capture_output=True, text=True, check=True).stdout.split()
                    ns, sa, va = float(res[0]), res[3], res[4]
                    at_peak = ffi_peaks.key_head_seconds(peaks[ffi_peaks.ARITHMETIC_PEAK[sa]],
                                                         peaks[ffi_peaks.ARITHMETIC_PEAK[va]], rows, HEAD_DIM)
                    nbytes = KVProfile(prof).token_head_bytes(HEAD_DIM)
                    rows_out.append([level, rows, prof, f"{sa} / {va}", f"{ns:.1f}", f"{100 * at_peak / (ns * 1e-9):.0f}%",
                                     nbytes, f"{nbytes / ns:.1f}"])
            peak_rows.append([level] + [f"{peaks[k] / 1e9:.1f}" if k in peaks else "-"
                                        for k in ("float32", "int16", "int8", "vnni16", "vnni8", "int8x2")])
    print(tabulate(rows_out, headers=["level", "rows", "profile", "arithmetic (scores / values)", "ns per key",
                                      "of peak", "K/V bytes per key-head", "compute ceiling GB/s"], tablefmt="github"))
    print("\nmultiply-add peaks, G per second (one thread):\n")
    print(tabulate(peak_rows, headers=["level", "float32 FMA", "int16 madd+add", "8-bit maddubs chain", "vnni16",
                                       "vnni8", "int8x2"], tablefmt="github"))


if __name__ == "__main__":
    main()
