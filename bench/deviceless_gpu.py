"""Deviceless GPU compile of every Pallas Triton kernel for the H200 (sm_90a), on a CPU machine.

Route (what works with JAX 0.10.2 and triton 3.9.0, no GPU, no CUDA plugin):

1. Lower each op for CUDA on the CPU (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``,
   ``interpret=False``), as ``tests/pallas/test_pallas_lowering.py`` does.  Pallas's Triton lowering
   (``jax._src.pallas.triton``) then emits one Triton IR (TTIR) module per kernel, for compute
   capability 9.0 (its fallback when no GPU is visible), and packs it with the launch knobs into the
   ``__gpu$xla.gpu.triton`` custom call.  We capture, per kernel, the module's text
   (``lower_jaxpr_to_triton_module``) and the knobs JAX hands to XLA (name, ``num_warps``,
   ``num_stages``, grid) from that custom call.
2. Compile the TTIR *text* with triton 3.9.0 (``triton.compile(path.ttir, target=GPUTarget("cuda",
   90, 32))``): TTIR -> TTGIR -> LLVM IR -> PTX (``.target sm_90a``) -> cubin.  JAX 0.10.2's TTIR text
   parses as is.  (The MLIR *bytecode* JAX puts in the custom call does not: triton reads a ``.ttir``
   source as UTF-8 text.)  Triton is pointed at the chosen ``ptxas`` (``TRITON_PTXAS_BLACKWELL_PATH``)
   and emits the PTX ISA version that ptxas accepts.  Triton's ``metadata.shared`` is the dynamic
   shared memory the kernel is launched with.
3. ``ptxas -arch=sm_90a -v`` on that PTX: registers per thread, spill stores / loads, static shared
   memory.  smem = Triton's dynamic shared memory + ptxas's static shared memory.

Two compilers for step 2 (``--compiler``):

* ``triton`` (the ``deviceless`` extra, triton==3.9.0): as above, TTIR text.
* ``xla``: XLA's own Triton, the pipeline a GPU run uses.  With ``jax-cuda13-plugin`` and
  ``jax-cuda13-pjrt`` 0.10.2 installed and ``JAX_PLATFORMS=cpu``, the plugin registers without a GPU
  (no cuDNN check) and with it its Triton compiler; ``jax._src.lib.triton.compile("cuda", bytecode,
  "9.0", num_warps=..., num_ctas=1, num_stages=...)`` turns the exact bytecode JAX hands to XLA into
  PTX (``.version 9.0``, ``.target sm_90a``) and its shared memory.  ``auto`` (the default) picks it
  when the plugin is installed.  The two differ by a few to ~40 registers per kernel (XLA's vendored
  Triton is not the wheel); shared memory has agreed where compared.  The plugin is *not* in the
  ``deviceless`` extra: installed next to a CPU-only jax it logs a cuInit / cuDNN error on every
  JAX start that does not pin ``JAX_PLATFORMS=cpu``.

``bench/gpu_check.py --predicted PATH`` prints these predictions next to the real timings.

Kernels: for every profile, both plane orders and head dims 64 / 128 / 256: paged decode attention
(T = 1, default config: the context split over programs), paged chunk attention (T = 256), paged
append for decode (T = 1) and chunk (T = 256); the ragged attention and append of a 1024-token round
of 64 rows (each two kernels: the decode rows' and the chunk rows'; the decode rows' kernels are
held to the decode rule); cyclic attention (T = 1 and T = 16) and cyclic append (T = 1 and T = 16),
order ``-``.  Shapes as on an H200 pool (B = 64 rows, H = 8 KV heads,
Hq = 32, 32K context, 16384 pages in 2 layers: planes past 2**31 elements, 64-bit offsets).

Exit status: 1 on a lowering / compile / ptxas error, a spill in a decode kernel (T = 1 attention
or append, or a ragged op's decode rows' kernel; spills elsewhere are printed as warnings) or shared memory above 227 KiB per block; 2
when triton or ptxas is missing.

Usage::

    PYTHONPATH=. JAX_PLATFORMS=cpu python bench/deviceless_gpu.py --json /tmp/predicted.json
    PYTHONPATH=. python bench/deviceless_gpu.py --profiles k8v4 --head-dims 128 --kinds decode append-decode
    PYTHONPATH=. python bench/deviceless_gpu.py --compiler triton     # the triton wheel even with the plugin
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's (and XLA's) default: FMA fusion on

ARCH = "sm_90a"
CAPABILITY = 90
SMEM_LIMIT = 227 * 1024  # H200 (sm_90): the most shared memory one block can opt in to
PROFILES = ["bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"]
ORDERS = ["page-major", "head-major"]
HEAD_DIMS = [64, 128, 256]
# kind -> (op, T); decode kinds are the T = 1 kernels of a decode step (no spill allowed)
KINDS = {
    "decode": ("paged_attention", 1),
    "chunk": ("paged_attention", 256),
    "append-decode": ("paged_append", 1),
    "append-chunk": ("paged_append", 256),
    "cyclic-decode": ("cyclic_attention", 1),
    "cyclic-chunk": ("cyclic_attention", 16),
    "cyclic-append-decode": ("cyclic_append", 1),
    "cyclic-append-chunk": ("cyclic_append", 16),
    "ragged": ("paged_attention_ragged", 1024),
    "append-ragged": ("paged_append_ragged", 1024),
}
DECODE_KINDS = {k for k, (_, t) in KINDS.items() if t == 1}
RAGGED_KINDS = {k for k, (op, _) in KINDS.items() if op.endswith("ragged")}
# A ragged op lowers to two kernels, its decode rows' and its chunk rows' (pallas_kernels/triton/ragged.py):
# the decode rows' kernel is held to the decode kinds' rule.
_RAGGED_DECODE_NAME = "_ragged_decode_"


@dataclasses.dataclass(frozen=True)
class Pool:
    """Abstract shapes the kernels are lowered for (nothing is allocated)."""

    batch: int = 64
    chunk_batch: int = 8
    kv_heads: int = 8
    q_heads: int = 32
    context: int = 32768
    num_pages: int = 16384
    num_layers: int = 2
    window: int = 4096


@dataclasses.dataclass
class Kernel:
    """One Triton kernel as lowered by JAX, and (after compiling) what ptxas says about it."""

    kind: str
    profile: str
    order: str
    head_dim: int
    name: str = ""
    num_warps: int = 0
    num_stages: int = 0
    grid: tuple = ()
    ttir: str = dataclasses.field(default="", repr=False)
    ttir_bytecode: bytes = dataclasses.field(default=b"", repr=False)  # what JAX hands to XLA
    compiler: str = ""
    regs: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_bytes: int | None = None
    smem_dynamic: int | None = None  # Triton's shared memory (launch-time dynamic)
    smem_static: int | None = None  # ptxas's static shared memory
    smem: int | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def decode(self) -> bool:
        return self.kind in DECODE_KINDS or (self.kind in RAGGED_KINDS and _RAGGED_DECODE_NAME in self.name)

    @property
    def spill(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)

    def problems(self) -> list[str]:
        """Why this kernel fails the check (empty: it passes)."""
        out = []
        if self.error:
            out.append(f"error: {self.error}")
        if self.decode and self.spill:
            out.append(f"decode kernel spills {self.spill_stores} B stores / {self.spill_loads} B loads")
        if self.smem is not None and self.smem > SMEM_LIMIT:
            out.append(f"shared memory {self.smem} B > {SMEM_LIMIT} B per block")
        return out

    def record(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("ttir")}
        d["grid"] = list(self.grid)
        d["decode"] = self.decode
        d["ok"] = not self.problems()
        return d


# -- tools -----------------------------------------------------------------------------------------


def find_ptxas(path: str | None = None) -> str | None:
    """The ptxas to use: ``path``, ``$PTXAS``, ``ptxas`` on ``PATH``, /usr/local/cuda/bin/ptxas."""
    for cand in (path, os.environ.get("PTXAS"), shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def ptxas_version(ptxas: str) -> str:
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "?"


def missing_tools(ptxas: str | None) -> str | None:
    """Why the deviceless compile cannot run here (``None``: it can)."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"triton is not importable ({type(exc).__name__}: {exc}); pip install '.[deviceless]'"
    if find_ptxas(ptxas) is None:
        return "ptxas not found (pass --ptxas, set $PTXAS or put CUDA's ptxas on PATH)"
    return None


# -- step 1: lower for CUDA and capture the TTIR ---------------------------------------------------


@contextlib.contextmanager
def capture_triton_kernels():
    """Yield a list that fills with ``(name, ttir_text, num_warps, num_stages, grid)`` per kernel lowered."""
    from jax._src.interpreters import mlir
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured: list = []
    texts: list = []
    lower_orig = registration.lowering.lower_jaxpr_to_triton_module
    custom_call_orig = mlir.custom_call

    def lower(*args, **kwargs):
        result = lower_orig(*args, **kwargs)
        texts.append(result.module.operation.get_asm())
        return result

    def custom_call(call_target_name, *args, backend_config=None, **kwargs):
        if call_target_name == "__gpu$xla.gpu.triton" and isinstance(backend_config, dict):
            bc = backend_config
            captured.append((bc["name"].value, texts[-1], bc["num_warps"].value, bc["num_stages"].value,
                             (bc["grid_x"].value, bc["grid_y"].value, bc["grid_z"].value), bc["ir"].value_bytes))
        return custom_call_orig(call_target_name, *args, backend_config=backend_config, **kwargs)

    registration.lowering.lower_jaxpr_to_triton_module = lower
    mlir.custom_call = custom_call
    try:
        yield captured
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower_orig
        mlir.custom_call = custom_call_orig


def _problem(kind: str, profile: str, order: str, head_dim: int, pool: Pool):
    """``(fn, args)`` of one op call with abstract shapes."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from ninfer_kv.schema.layout import PagedKVStorageLayout
    from ninfer_kv.ops.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

    op, t = KINDS[kind]
    if op.endswith("ragged"):
        return _ragged_problem(op, t, profile, order, head_dim, pool)
    bsz = pool.batch if t == 1 else pool.chunk_batch
    i32 = jax.ShapeDtypeStruct((bsz,), jnp.int32)
    h, d = pool.kv_heads, head_dim
    if op.startswith("cyclic"):
        lay = CyclicKVLayout(profile, pool.num_layers, bsz + 1, h, d, window=pool.window, slots=pool.window + 16)
        planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes().items()}
        view = CyclicKVCacheLayerView(planes, jax.ShapeDtypeStruct((), jnp.int32), lay, validate=False)
    else:
        lay = PagedKVStorageLayout(profile, pool.num_layers, h, d, order)
        planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(pool.num_pages).items()}
        table = jax.ShapeDtypeStruct((bsz + 1, pool.context // 64), jnp.int32)
        view = PagedKVBatchLayerView(planes, table, jax.ShapeDtypeStruct((), jnp.int32), lay, validate=False)
    if op.endswith("append"):
        kv = jax.ShapeDtypeStruct((bsz, t, h, d), jnp.bfloat16)
        fn = getattr(pk, op)
        return (lambda v, r, p, k, vv, n: fn(v, r, p, k, vv, n, interpret=False)), (view, i32, i32, kv, kv, i32)
    q = jax.ShapeDtypeStruct((bsz, t, pool.q_heads, d), jnp.bfloat16)
    fn = getattr(pk, op)
    return (lambda q, v, r, p, n: fn(q, v, r, p, n, interpret=False)), (q, view, i32, i32, i32)


def _ragged_problem(op: str, num_tokens: int, profile: str, order: str, head_dim: int, pool: Pool):
    """``(fn, args)`` of a ragged round: ``num_tokens`` tokens of ``pool.batch`` rows (decodes and chunks)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from ninfer_kv.schema.layout import PagedKVStorageLayout
    from ninfer_kv.ops.views import PagedKVBatchLayerView

    rows = jax.ShapeDtypeStruct((pool.batch,), jnp.int32)
    starts = jax.ShapeDtypeStruct((pool.batch + 1,), jnp.int32)
    h, d = pool.kv_heads, head_dim
    lay = PagedKVStorageLayout(profile, pool.num_layers, h, d, order)
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(pool.num_pages).items()}
    table = jax.ShapeDtypeStruct((pool.batch + 1, pool.context // 64), jnp.int32)
    view = PagedKVBatchLayerView(planes, table, jax.ShapeDtypeStruct((), jnp.int32), lay, validate=False)
    fn = getattr(pk, op)
    if op == "paged_append_ragged":
        kv = jax.ShapeDtypeStruct((num_tokens, h, d), jnp.bfloat16)
        return (lambda v, r, p, k, vv, s: fn(v, r, p, k, vv, s, interpret=False)), (view, rows, rows, kv, kv, starts)
    q = jax.ShapeDtypeStruct((num_tokens, pool.q_heads, d), jnp.bfloat16)
    return ((lambda q, v, r, p, n, s: fn(q, v, r, p, n, s, interpret=False)),
            (q, view, rows, rows, rows, starts))


def lower_kernels(kind: str, profile: str, order: str, head_dim: int, pool: Pool = Pool()) -> list[Kernel]:
    """Lower one op for CUDA on this machine; one :class:`Kernel` (TTIR + knobs) per Triton kernel."""
    import jax

    try:
        fn, args = _problem(kind, profile, order, head_dim, pool)
        with capture_triton_kernels() as captured:
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        if not captured:
            raise RuntimeError("no Triton kernel was lowered")
    except Exception as exc:  # noqa: BLE001
        return [Kernel(kind, profile, order, head_dim, error=f"lowering: {type(exc).__name__}: {exc}"[:400])]
    return [Kernel(kind, profile, order, head_dim, name=n, num_warps=w, num_stages=s, grid=g, ttir=text,
                   ttir_bytecode=bc) for n, text, w, s, g, bc in captured]


# -- steps 2 and 3: triton -> PTX / cubin, ptxas -v ------------------------------------------------

_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict:
    """Registers, stack, spills and static shared memory of the (single) function in a ``ptxas -v`` log."""
    regs = [int(x) for x in _REGS.findall(log)]
    spills = [tuple(map(int, m)) for m in _SPILL.findall(log)]
    smem = [int(x) for x in _SMEM.findall(log)]
    if not regs:
        raise ValueError(f"no register count in the ptxas log: {log[-400:]!r}")
    return dict(regs=max(regs), stack_bytes=max((s[0] for s in spills), default=0),
                spill_stores=sum(s[1] for s in spills), spill_loads=sum(s[2] for s in spills),
                smem_static=max(smem, default=0))


def xla_triton_available() -> bool:
    """Whether XLA's own Triton compiler is registered (the CUDA PJRT plugin, jax-cuda13-plugin, installed;
    it registers without a GPU under ``JAX_PLATFORMS=cpu``)."""
    try:
        import jax
        from jax._src.lib import triton as jax_triton

        jax.devices()  # plugin discovery and registration
        return jax_triton.has_compilation_handler("CUDA")
    except Exception:  # noqa: BLE001
        return False


def _ptxas_figures(ptx: str, ptxas: str, path: str) -> dict:
    if f".target {ARCH}" not in ptx:
        raise RuntimeError(f"the PTX does not target {ARCH}: {re.search(r'.target .*', ptx)}")
    with open(path, "w") as f:
        f.write(ptx)
    res = subprocess.run([ptxas, f"-arch={ARCH}", "-v", path, "-o", path[:-4] + ".cubin"], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas failed: {(res.stderr or res.stdout).strip()[-400:]}")
    return parse_ptxas(res.stderr + res.stdout)


def _record(out: dict, ptx: str, smem_dynamic: int, ptxas: str, ptx_path: str) -> None:
    """ptxas's figures of ``ptx`` into ``out``, shared memory = Triton's dynamic + ptxas's static."""
    out.update(_ptxas_figures(ptx, ptxas, ptx_path))
    out["smem_dynamic"] = smem_dynamic
    out["smem"] = smem_dynamic + out["smem_static"]


def _record_error(out: dict, exc: Exception) -> None:
    first = str(exc).strip().splitlines()
    out["error"] = f"compile: {type(exc).__name__}: {' '.join(first[:3])}"[:400]


def compile_kernel_xla(job: tuple) -> dict:
    """TTIR bytecode -> PTX with XLA's Triton (``jax._src.lib.triton.compile``, as the plugin does on a GPU)
    -> ``ptxas -v``.  Runs in this process (the plugin's handler is registered here)."""
    name, bytecode, num_warps, num_stages, ptxas, workdir = job
    t0 = time.perf_counter()
    out: dict = {"compiler": "xla"}
    try:
        from jax._src.lib import triton as jax_triton

        res = jax_triton.compile("cuda", bytecode, f"{CAPABILITY // 10}.{CAPABILITY % 10}", num_warps=num_warps,
                                 num_ctas=1, num_stages=num_stages)
        _record(out, res.asm, int(res.smem_bytes), ptxas, os.path.join(workdir, f"{name}.ptx"))
    except Exception as exc:  # noqa: BLE001
        _record_error(out, exc)
    out["seconds"] = time.perf_counter() - t0
    return out


def compile_kernel(job: tuple) -> dict:
    """TTIR text -> (triton) PTX + cubin for sm_90a -> ``ptxas -v``.  Runs in a worker process."""
    name, ttir, num_warps, num_stages, ptxas, workdir = job
    t0 = time.perf_counter()
    out: dict = {"compiler": "triton"}
    try:
        os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = ptxas  # triton uses it (and its PTX ISA) for sm >= 90
        os.environ["TRITON_PTXAS_PATH"] = ptxas
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(workdir, "triton-cache"))
        import triton
        from triton.backends.compiler import GPUTarget

        src = os.path.join(workdir, f"{name}.ttir")
        with open(src, "w") as f:
            f.write(ttir)
        compiled = triton.compile(src, target=GPUTarget("cuda", CAPABILITY, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
        _record(out, compiled.asm["ptx"], int(compiled.metadata.shared), ptxas, os.path.join(workdir, f"{name}.ptx"))
    except Exception as exc:  # noqa: BLE001
        _record_error(out, exc)
    out["seconds"] = time.perf_counter() - t0
    return out


def run(profiles=PROFILES, orders=ORDERS, head_dims=HEAD_DIMS, kinds=tuple(KINDS), *, ptxas: str | None = None,
        jobs: int | None = None, pool: Pool = Pool(), workdir: str | None = None, log=print,
        compiler: str = "triton") -> list[Kernel]:
    """Lower and compile every requested kernel; returns them with their ptxas figures (or errors).

    ``compiler``: ``"triton"`` (the triton wheel, TTIR text) or ``"xla"`` (XLA's Triton through the CUDA
    PJRT plugin, TTIR bytecode: the pipeline a GPU run uses)."""
    ptxas = find_ptxas(ptxas)
    why = missing_tools(ptxas) if compiler == "triton" else (None if ptxas else "ptxas not found")
    if compiler == "xla" and not xla_triton_available():
        why = "XLA's Triton compiler is not registered (install jax-cuda13-plugin and jax-cuda13-pjrt)"
    if why:
        raise RuntimeError(why)
    kernels: list[Kernel] = []
    t0 = time.perf_counter()
    for kind in kinds:
        cyclic = KINDS[kind][0].startswith("cyclic")
        for profile in profiles:
            for order in (["-"] if cyclic else orders):
                for d in head_dims:
                    kernels.extend(lower_kernels(kind, profile, order, d, pool))
    log(f"lowered {len(kernels)} Triton kernels for CUDA in {time.perf_counter() - t0:.1f} s")
    todo = [k for k in kernels if not k.error]
    jobs = max(1, jobs or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="deviceless-gpu-") as tmp:
        work = workdir or tmp
        os.makedirs(work, exist_ok=True)
        t1 = time.perf_counter()
        names = [f"k{i:04d}_{k.name}"[:200] for i, k in enumerate(todo)]
        ex = None
        if compiler == "xla":  # in this process, where the plugin registered its compiler (fast: one at a time)
            jobs = 1
            results = map(compile_kernel_xla, [(n, k.ttir_bytecode, k.num_warps, k.num_stages, ptxas, work)
                                               for n, k in zip(names, todo)])
        else:
            args = [(n, k.ttir, k.num_warps, k.num_stages, ptxas, work) for n, k in zip(names, todo)]
            if jobs == 1:
                results = map(compile_kernel, args)
            else:
                ex = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
                results = ex.map(compile_kernel, args)
        try:
            for k, r in zip(todo, results):
                for key, value in r.items():
                    setattr(k, key, value)
        finally:
            if ex is not None:
                ex.shutdown()
        log(f"compiled {len(todo)} kernels with {compiler}'s Triton to PTX and cubin ({ARCH}, ptxas "
            f"{ptxas_version(ptxas)}) with {jobs} process(es) in {time.perf_counter() - t1:.1f} s")
    return kernels


# -- report ----------------------------------------------------------------------------------------


def table(kernels: list[Kernel]) -> str:
    rows = ["| kernel | kind | profile | order | D | warps | stages | regs | spill bytes (st/ld) | smem bytes | result |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in kernels:
        problems = k.problems()
        if k.error:
            figures = "| - | - | - "
        else:
            figures = f"| {k.regs} | {k.spill_stores}/{k.spill_loads} | {k.smem} "
        result = "FAIL: " + "; ".join(problems) if problems else ("PASS (spills)" if k.spill else "PASS")
        rows.append(f"| {k.name or '-'} | {k.kind} | {k.profile} | {k.order} | {k.head_dim} | {k.num_warps} | "
                    f"{k.num_stages} {figures}| {result.replace('|', '/')} |")
    return "\n".join(rows)


def summary(kernels: list[Kernel]) -> dict:
    ok = [k for k in kernels if not k.error]
    return dict(
        kernels=len(kernels),
        errors=sum(1 for k in kernels if k.error),
        failures=sum(1 for k in kernels if k.problems()),
        max_regs=max((k.regs for k in ok), default=None),
        spilling=[k.name for k in ok if k.spill],
        decode_spilling=[k.name for k in ok if k.spill and k.decode],
        max_smem=max((k.smem for k in ok), default=None),
        smem_limit=SMEM_LIMIT,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", nargs="+", default=PROFILES, choices=PROFILES)
    parser.add_argument("--orders", nargs="+", default=ORDERS, choices=ORDERS)
    parser.add_argument("--head-dims", nargs="+", type=int, default=HEAD_DIMS)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--ptxas", help="ptxas binary (default: $PTXAS, ptxas on PATH, /usr/local/cuda/bin/ptxas)")
    parser.add_argument("--compiler", choices=["triton", "xla", "auto"], default="auto",
                        help="triton: the triton wheel (TTIR text); xla: XLA's Triton via the CUDA PJRT plugin "
                             "(TTIR bytecode, the GPU run's pipeline); auto: xla when the plugin is installed")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count)")
    parser.add_argument("--json", help="write every kernel's figures here")
    parser.add_argument("--keep", help="keep TTIR / PTX / cubin files in this directory")
    args = parser.parse_args(argv)
    compiler = args.compiler
    if compiler == "auto":
        compiler = "xla" if xla_triton_available() else "triton"
    why = missing_tools(args.ptxas) if compiler == "triton" else None
    if compiler == "xla" and not xla_triton_available():
        why = "XLA's Triton compiler is not registered (install jax-cuda13-plugin and jax-cuda13-pjrt)"
    if why:
        print(f"cannot compile without a GPU here: {why}")
        return 2
    import jax

    if compiler == "triton":
        import triton

        triton_version = triton.__version__
    else:
        import importlib.metadata

        triton_version = f"XLA's (jax-cuda13-plugin {importlib.metadata.version('jax-cuda13-plugin')})"
    ptxas = find_ptxas(args.ptxas)
    if ptxas is None:
        print("cannot compile without a GPU here: ptxas not found")
        return 2
    start = time.perf_counter()
    print(f"# Deviceless compile for the H200 ({ARCH}): jax {jax.__version__}, triton {triton_version}, "
          f"ptxas {ptxas_version(ptxas)} ({ptxas})", flush=True)
    kernels = run(args.profiles, args.orders, args.head_dims, args.kinds, ptxas=ptxas, jobs=args.jobs,
                  workdir=args.keep, log=lambda s: print(s, flush=True), compiler=compiler)
    print()
    print(table(kernels))
    s = summary(kernels)
    print()
    print(f"{s['kernels']} kernels, {s['errors']} errors; max {s['max_regs']} registers/thread; "
          f"{len(s['spilling'])} spilling ({len(s['decode_spilling'])} decode); max smem {s['max_smem']} B "
          f"(limit {SMEM_LIMIT} B); {s['failures']} failing ({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(arch=ARCH, jax=jax.__version__, triton=triton_version, compiler=compiler,
                           ptxas=ptxas_version(ptxas), pool=dataclasses.asdict(Pool()), summary=s,
                           kernels=[k.record() for k in kernels]), f, indent=1)
        print(f"wrote {args.json}")
    return 1 if s["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
