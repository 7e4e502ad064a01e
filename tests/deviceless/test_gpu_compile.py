"""Every Pallas Triton kernel kind compiles for the H200 (sm_90a) on this CPU machine, within budget.

bench/deviceless_gpu.py's core on a representative subset: JAX lowers the ops for CUDA (Triton IR),
triton compiles that IR to PTX and a cubin for sm_90a, and ``ptxas -v`` reports registers, spills
and shared memory.  Fails on a compile error, a spill in a decode (T = 1) kernel or more shared
memory than an H200 block can have.  Skips (with the reason) without triton or ptxas: install the
``deviceless`` extra and CUDA's ptxas (``$PTXAS``, ``PATH`` or /usr/local/cuda/bin).

Also pinned: what whole-program compilation for CUDA does without a GPU (it does not compile for
the GPU; see ``test_whole_program_compile_needs_a_cuda_backend``).
"""

import importlib
import pathlib
import sys

import pytest

pytestmark = pytest.mark.deviceless

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def dg():
    sys.path.insert(0, str(_BENCH))  # importable by name: the compile workers are spawned processes
    try:
        module = importlib.import_module("deviceless_gpu")
    finally:
        sys.path.remove(str(_BENCH))
    why = module.missing_tools(None)
    if why:
        pytest.skip(why)
    return module


# Every kernel kind once, every profile at least once, both orders, D = 64 / 128 / 256, the widest
# (D = 256 attention: 8 warps) and the one at the register cap (chunk attention).
SUBSET = [
    ("decode", "k8v4", "page-major", 128),
    ("decode", "bf16", "head-major", 256),
    ("decode", "bf16", "page-major", 256),
    ("decode", "nvfp4-g16", "head-major", 64),
    ("chunk", "int8-g64", "page-major", 128),
    ("chunk", "fp8-e4m3fn-row256", "head-major", 256),
    ("append-decode", "nvfp4-g16", "page-major", 128),
    ("append-chunk", "k8v4", "head-major", 256),
    ("cyclic-decode", "int8-g64", "-", 128),
    ("cyclic-chunk", "k8v4", "-", 64),
    ("cyclic-append-decode", "fp8-e4m3fn-row256", "-", 128),
    ("cyclic-append-chunk", "bf16", "-", 256),
    ("ragged", "bf16", "head-major", 256),
    ("ragged", "k8v4", "page-major", 128),
    ("append-ragged", "nvfp4-g16", "head-major", 128),
]


@pytest.fixture(scope="module")
def compiled(dg, tmp_path_factory):
    kernels = []
    for kind, profile, order, d in SUBSET:
        kernels += dg.lower_kernels(kind, profile, order, d)
    work = str(tmp_path_factory.mktemp("deviceless"))
    ptxas = dg.find_ptxas(None)
    for i, k in enumerate(kernels):
        if not k.error:
            job = (f"k{i}_{k.name}", k.ttir, k.num_warps, k.num_stages, ptxas, work)
            for key, value in dg.compile_kernel(job).items():
                setattr(k, key, value)
    print()
    print(dg.table(kernels))
    return kernels


def _case(c):
    return pytest.param(c, id="-".join(map(str, c)))


def test_the_subset_covers_every_kind_and_profile(dg, compiled):
    assert {k.kind for k in compiled} == set(dg.KINDS)
    assert {k.profile for k in compiled} == set(dg.PROFILES)
    assert {k.head_dim for k in compiled} == set(dg.HEAD_DIMS)


@pytest.mark.parametrize("case", [_case(c) for c in SUBSET])
def test_kernel_compiles_for_sm90a_within_budget(dg, compiled, case):
    kernels = [k for k in compiled if (k.kind, k.profile, k.order, k.head_dim) == case]
    assert kernels
    for k in kernels:
        assert not k.problems(), (k.name, k.problems())
        assert k.regs and 0 < k.regs <= 255, k
        assert k.smem is not None and 0 <= k.smem <= dg.SMEM_LIMIT, k
        assert k.num_warps in (4, 8), k
        if "attention" in k.name:
            assert k.smem_dynamic > 0  # the pipelined key loop stages K/V tiles in shared memory


def test_a_ragged_op_lowers_to_its_decode_and_chunk_kernels(compiled):
    """The ragged attention and append are two kernels each (decode rows, chunk rows); the decode
    rows' kernel is held to the decode rule (no spill) like a T = 1 kernel."""
    for kind in ("ragged", "append-ragged"):
        names = sorted(k.name for k in compiled if k.kind == kind and k.profile in ("bf16", "nvfp4-g16"))
        assert any("_ragged_decode_" in n for n in names) and any("_ragged_chunk_" in n for n in names), names
    decode = [k for k in compiled if k.kind == "ragged" and "_ragged_decode_" in k.name]
    assert decode and all(k.decode and not k.spill for k in decode), decode


def test_the_checks_fail_on_what_they_guard(dg, tmp_path):
    """A decode spill, too much shared memory and a compile error each fail the check."""
    k = dg.Kernel("decode", "bf16", "page-major", 128, name="x", regs=255, spill_stores=8, spill_loads=8, smem=100)
    assert any("spills" in p for p in k.problems())
    k = dg.Kernel("chunk", "bf16", "page-major", 128, name="x", regs=255, spill_stores=8, spill_loads=8, smem=100)
    assert not k.problems()  # a chunk kernel may spill (reported, not failed)
    k = dg.Kernel("chunk", "bf16", "page-major", 128, name="x", regs=64, spill_stores=0, spill_loads=0,
                  smem=dg.SMEM_LIMIT + 1)
    assert any("shared memory" in p for p in k.problems())
    bad = dg.compile_kernel(("bad", "module {\n  tt.func @f( {\n}", 4, 1, dg.find_ptxas(None), str(tmp_path)))
    assert bad["error"].startswith("compile:")
    log = ("ptxas info    : Function properties for f\n"
           "    16 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]\n")
    assert dg.parse_ptxas(log) == dict(regs=255, stack_bytes=16, spill_stores=12, spill_loads=4, smem_static=1024)


def test_whole_program_compile_needs_a_cuda_backend():
    """JAX 0.10.2 on a CPU-only install cannot compile a whole CUDA-lowered program (e.g. a decoder
    step) for the GPU: ``Lowered.compile()`` compiles for the default (CPU) backend, which has no
    handler for the Triton custom call, and there is no deviceless CUDA topology without the CUDA
    PJRT plugin.  If this starts passing differently, the docs' "what is proven how" changes."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    import pallas_kernels as pk
    from ninfer_kv.schema.layout import PagedKVStorageLayout
    from ninfer_kv.ops.views import PagedKVBatchLayerView

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is attached: this pins the deviceless behaviour")
    lay = PagedKVStorageLayout("k8v4", 2, 2, 128, "page-major")
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(16).items()}
    i32 = jax.ShapeDtypeStruct((3,), jnp.int32)
    table, layer = jax.ShapeDtypeStruct((4, 8), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)
    view = PagedKVBatchLayerView(planes, table, layer, lay, validate=False)
    q = jax.ShapeDtypeStruct((3, 1, 8, 128), jnp.bfloat16)
    fn = lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, interpret=False)  # noqa: E731
    lowered = jax.jit(fn).trace(q, view, i32, i32, i32).lower(lowering_platforms=("cuda",))
    with pytest.raises(Exception, match=r"No FFI handler registered for __gpu\$xla\.gpu\.triton"):
        lowered.compile()
    with pytest.raises(NotImplementedError, match="topology not implemented for cuda"):
        topologies.get_topology_desc("h200", platform="cuda")


@pytest.mark.parametrize("op, profile, order, d", [
    pytest.param("paged_attention", "bf16", "page-major", 128, id="decode-bf16-page-major-128"),
    pytest.param("paged_attention_ragged", "k8v4", "head-major", 128, id="ragged-k8v4-head-major-128"),
])
def test_windowed_soft_capped_sink_attention_compiles_for_sm90a(dg, tmp_path, op, profile, order, d):
    """A sliding window, a logit soft cap and attention sinks (a traced ``(Hq,)`` operand) together
    lower for CUDA and compile for sm_90a; the decode kernels stay within the decode rule (no spill)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from ninfer_kv.schema.layout import PagedKVStorageLayout
    from ninfer_kv.ops.views import PagedKVBatchLayerView

    bsz, h, hq = 8, 8, 32
    lay = PagedKVStorageLayout(profile, 2, h, d, order)
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(4096).items()}
    view = PagedKVBatchLayerView(planes, jax.ShapeDtypeStruct((bsz + 1, 128), jnp.int32),
                                 jax.ShapeDtypeStruct((), jnp.int32), lay, validate=False)
    i32, sinks = jax.ShapeDtypeStruct((bsz,), jnp.int32), jax.ShapeDtypeStruct((hq,), jnp.float32)
    opts = dict(window=1024, soft_cap=30.0, interpret=False)
    if op == "paged_attention":
        q = jax.ShapeDtypeStruct((bsz, 1, hq, d), jnp.bfloat16)
        fn, args = (lambda q, v, r, p, n, s: pk.paged_attention(q, v, r, p, n, sinks=s, **opts)), (q, view, i32, i32,
                                                                                                  i32, sinks)
    else:
        q = jax.ShapeDtypeStruct((256, hq, d), jnp.bfloat16)
        starts = jax.ShapeDtypeStruct((bsz + 1,), jnp.int32)
        fn = lambda q, v, r, p, n, st, s: pk.paged_attention_ragged(q, v, r, p, n, st, sinks=s, **opts)  # noqa: E731
        args = (q, view, i32, i32, i32, starts, sinks)
    with dg.capture_triton_kernels() as captured:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert captured
    ptxas = dg.find_ptxas(None)
    for i, (name, ttir, warps, stages, grid, bc) in enumerate(captured):
        assert "_w1024_cap30_sinks" in name, name
        k = dg.Kernel("decode" if op == "paged_attention" else "ragged", profile, order, d, name=name,
                      num_warps=warps, num_stages=stages, grid=grid, ttir=ttir)
        for key, value in dg.compile_kernel((f"v{i}_{name}", ttir, warps, stages, ptxas, str(tmp_path))).items():
            setattr(k, key, value)
        assert not k.problems(), (name, k.problems())
        assert k.regs and 0 < k.regs <= 255 and k.smem <= dg.SMEM_LIMIT, k
