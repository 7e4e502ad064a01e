"""The NEON level run for real: tests/ffi/neon_check.cc under qemu-aarch64.

The check program is built with the kernel sources that need no XLA headers (attention_core.cc,
dequantize.cc, quantize.cc), with the compiler flags of ffi/CMakeLists.txt, twice:

* for AArch64 (the neon level, Debian's aarch64-linux-gnu-g++) and run under qemu-aarch64 with the
  cross sysroot (directly on an AArch64 host);
* natively at the baseline level (the portable code), so that the check itself is known to pass on
  the reference path (at -O1: the library's own tests cover that level at -O3; this keeps the
  test's wall time down).  This run is under ``-m slow``; the build is made only when asked for.

It compares the intrinsic hot spots, quantization, decoding and the attention core against the
scalar codec and a double-precision attention.  In CI (``CI=true``) a missing cross compiler or
qemu-aarch64 is a failure, not a skip.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "ffi" / "src"
CHECK = Path(__file__).resolve().parent / "neon_check.cc"
SYSROOT = Path("/usr/aarch64-linux-gnu")

# As ffi/CMakeLists.txt: -O3, no -ffast-math, multiply-adds fused except in quantize.cc.  The check
# program compares against references bit for bit, so it fuses nothing either (and -O1 serves it:
# the kernel units keep -O3).
COMMON = ["-std=gnu++17", "-O3", "-fno-math-errno", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-psabi",
          f"-I{SRC}"]
UNITS = [  # (source, extra flags), slowest first
    (SRC / "attention_core.cc", ["-ffp-contract=fast"]),
    (CHECK, ["-O1", "-ffp-contract=off"]),
    (SRC / "quantize.cc", ["-ffp-contract=off"]),
    (SRC / "dequantize.cc", ["-ffp-contract=fast"]),
]
IS_X86 = platform.machine() in ("x86_64", "AMD64")
IS_ARM64 = platform.machine() in ("aarch64", "arm64")


def _missing(msg: str):
    if os.environ.get("CI") == "true":
        pytest.fail(msg + "; CI must run the emulated NEON check")
    pytest.skip(msg)


def _targets(tmp: Path) -> dict[str, dict]:
    """The builds to make: name -> compiler, level flags, output, runner, expected SIMD path."""
    targets = {}
    native_cxx = shutil.which("g++") or shutil.which("c++")
    if native_cxx is not None and not IS_ARM64:
        level = ["-DNINFER_KV_ISA_ID=baseline", "-O1"] + (["-march=x86-64"] if IS_X86 else [])
        targets["native"] = dict(cxx=native_cxx, flags=level, runner=[], simd="portable")
    if IS_ARM64:
        cxx, runner = native_cxx, []
    else:
        cxx = shutil.which("aarch64-linux-gnu-g++")
        qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
        runner = [qemu, "-L", str(SYSROOT)] if qemu else None
    if cxx is not None and runner is not None:
        targets["neon"] = dict(cxx=cxx, flags=["-DNINFER_KV_ISA_ID=neon"], runner=runner, simd="neon")
    for name, t in targets.items():
        t["dir"] = tmp / name
        t["dir"].mkdir()
    return targets


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``build(name)``: the named build (``"neon"`` or ``"native"``), compiled on first request (up to
    two compilers at a time), or ``None`` when this host cannot make it."""
    targets = _targets(tmp_path_factory.mktemp("neon_check"))
    done: set = set()

    def compile_one(job):
        t, src, extra = job
        obj = t["dir"] / (src.stem + ".o")
        res = subprocess.run([t["cxx"], *COMMON, *t["flags"], *extra, "-c", str(src), "-o", str(obj)],
                             capture_output=True, text=True, timeout=300)
        return obj, res

    def build(name: str) -> dict | None:
        t = targets.get(name)
        if t is None or name in done:
            return t
        with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
            results = list(pool.map(compile_one, [(t, src, extra) for src, extra in UNITS]))
        t["error"] = "".join(f"{obj.name}:\n{res.stderr[-4000:]}" for obj, res in results if res.returncode != 0)
        if not t["error"]:
            exe = t["dir"] / "neon_check"
            res = subprocess.run([t["cxx"], *(str(obj) for obj, _ in results), "-o", str(exe)], capture_output=True,
                                 text=True, timeout=120)
            t["error"] = res.stderr[-4000:] if res.returncode != 0 else ""
            t["exe"] = exe
        done.add(name)
        return t

    return build


def _run_check(t: dict) -> str:
    assert not t["error"], f"building the check failed:\n{t['error']}"
    res = subprocess.run([*t["runner"], str(t["exe"])], capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and out.rstrip().endswith("PASS"), f"check failed (rc {res.returncode}):\n{out[-6000:]}"
    # The build took the intended code path (the NEON branches, or the portable reference).
    assert f"simd {t['simd']}," in out.splitlines()[0], out.splitlines()[0]
    return out


def test_neon_check_runs_under_qemu(request):
    if not IS_ARM64:  # the tools first, before anything is built
        if shutil.which("aarch64-linux-gnu-g++") is None:
            _missing("aarch64-linux-gnu-g++ is not installed (Debian: apt-get install g++-aarch64-linux-gnu)")
        if shutil.which("qemu-aarch64") is None and shutil.which("qemu-aarch64-static") is None:
            _missing("qemu-aarch64 is not installed (Debian: apt-get install qemu-user)")
        if not (SYSROOT / "lib").is_dir():
            _missing(f"the aarch64 sysroot {SYSROOT} is missing (Debian: apt-get install g++-aarch64-linux-gnu)")
    neon = request.getfixturevalue("built")("neon")
    if neon is None:
        pytest.skip("no C++ compiler")
    _run_check(neon)


@pytest.mark.slow  # the reference run of the check itself; the NEON run above is the default test
def test_check_passes_on_the_portable_path(request):
    native = request.getfixturevalue("built")("native")
    if native is None:
        pytest.skip("no native C++ compiler, or the host is AArch64 (the NEON test runs natively)")
    _run_check(native)
