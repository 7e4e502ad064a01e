"""Build properties of the FFI library: per-level code stays in its level, the Arm sources compile.

* Only the code of the AVX2 / AVX-512 (or -march=native) levels may use 256- or 512-bit registers:
  the dispatcher, the thread pool, the baseline level and every C++ library function the linker
  kept must run on any x86-64 CPU (a template instantiated by several levels must resolve to a
  copy that runs everywhere).
* The NEON level compiles with Debian's aarch64 cross compiler (a syntax check of all sources).  In
  CI (``CI=true``) a missing cross compiler is a failure, not a skip.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ninfer_kv.ops.ffi import handlers as ffi_handlers

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "ffi" / "src"
WIDE_LEVELS = ("isa_avx2", "isa_avx512", "isa_native")


@pytest.mark.skipif(not ffi_handlers.is_available(), reason=f"FFI library unavailable: {ffi_handlers.load_error()}")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 register check")
def test_only_the_avx_levels_use_wide_registers():
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    info = ffi_handlers.info()
    assert "native" in info.compiled or "baseline" in info.compiled, info.compiled
    res = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", ffi_handlers.library_path()], capture_output=True,
                         text=True, timeout=120, check=True)
    header = re.compile(r"^[0-9a-f]+ <(.*)>:$")
    offenders, function, counted = [], None, 0
    for line in res.stdout.splitlines():
        m = header.match(line)
        if m:
            function = m.group(1)
            counted += 1
            continue
        if function is not None and ("%ymm" in line or "%zmm" in line):
            if not any(ns in function for ns in WIDE_LEVELS):
                offenders.append(function)
            function = None  # one report per function
    assert counted > 100, "objdump listed too few functions"
    assert not offenders, f"{len(offenders)} functions outside the AVX levels use ymm/zmm registers: {offenders[:5]}"


def _xla_include_dir() -> Path:
    try:
        import jaxlib

        d = Path(jaxlib.__file__).parent / "include"
        if (d / "xla" / "ffi" / "api" / "ffi.h").is_file():
            return d
    except ImportError:
        pass
    import jax.ffi

    return Path(jax.ffi.include_dir())


def test_neon_sources_cross_compile(tmp_path):
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        msg = "aarch64-linux-gnu-g++ is not installed (Debian: apt-get install g++-aarch64-linux-gnu)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + "; CI must run the NEON cross-compile check")
        pytest.skip(msg)
    (tmp_path / "ninfer_kv_levels.inc").write_text("NINFER_KV_LEVEL(neon)\n")
    sources = sorted(SRC.glob("*.cc"))
    assert len(sources) >= 10
    # One translation unit including every source: the XLA FFI headers are parsed once.
    unity = tmp_path / "all_sources.cc"
    unity.write_text("".join(f'#include "{src}"\n' for src in sources))
    flags = ["-std=gnu++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-Wno-psabi",
             "-DNINFER_KV_ISA_ID=neon", f"-I{SRC}", f"-I{tmp_path}", "-isystem", str(_xla_include_dir())]
    res = subprocess.run([cxx, *flags, str(unity)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"aarch64 (NEON) compile failed:\n{res.stderr[-4000:]}"
    # The NEON level is the one the dispatcher would pick there: it declares NEON as its feature.
    macros = subprocess.run([cxx, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, check=True)
    assert "#define __ARM_NEON 1" in macros.stdout
