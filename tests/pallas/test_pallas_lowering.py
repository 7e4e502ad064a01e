"""Every kernel variant lowers for CUDA on this CPU machine (interpret=False, Triton lowering).

The Pallas interpreter accepts programs the Triton lowering rejects (``round``, slicing loaded
values, f8 constants ...), so this is a test of its own.  Lowering stops before PTX: it proves
the kernels are expressible in Triton IR, not that they are fast or run on a given GPU.

Also checked on the lowered (CUDA) programs: the planes are consumed by the kernel only (no
gather, slice or staging copy of them outside it) and the append aliases them input -> output.
"""

import math
import re
import threading

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jax_core

import pallas_kernels as pk
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.ops.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

B, H, G, D, N_PAGES, WIDTH = 3, 2, 4, 128, 16, 8


def _paged_view(profile, order, head_dim=D, *, kv_heads=H, num_pages=N_PAGES, num_layers=2):
    lay = PagedKVStorageLayout(profile, num_layers, kv_heads, head_dim, order)
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(num_pages).items()}
    bt = jax.ShapeDtypeStruct((B + 1, WIDTH), jnp.int32)
    return PagedKVBatchLayerView(planes, bt, jax.ShapeDtypeStruct((), jnp.int32), lay, validate=False)


def _cyclic_view(profile):
    lay = CyclicKVLayout(profile, 2, B + 1, H, D, window=48, slots=64)
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes().items()}
    return CyclicKVCacheLayerView(planes, jax.ShapeDtypeStruct((), jnp.int32), lay, validate=False)


_I32 = jax.ShapeDtypeStruct((B,), jnp.int32)


def _lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _tokens(t, heads, dtype=jnp.bfloat16, head_dim=D):
    return jax.ShapeDtypeStruct((B, t, heads, head_dim), dtype)


PROFILES = [p.value for p in KVProfile]
ORDERS = ("page-major", "head-major")
# Every profile by default, both orders, head dims that are not powers of two (padded tiles); the
# other (profile, order) pairs at D = 128 with -m slow.
DEFAULT_CASES = (
    ("bf16", "page-major", 80),
    ("int8-g64", "head-major", 192),
    ("fp8-e4m3fn-row256", "page-major", 96),
    ("nvfp4-g16", "head-major", 80),
    ("k8v4", "page-major", 64),
)
_ALL_PAIRS = [(p, o, D) for p in PROFILES for o in ORDERS if (p, o, D) not in DEFAULT_CASES]


@pytest.mark.parametrize(
    "profile,order,head_dim",
    list(DEFAULT_CASES) + [pytest.param(*c, marks=pytest.mark.slow) for c in _ALL_PAIRS],
)
def test_paged_kernels_lower_for_cuda(profile, order, head_dim):
    view = _paged_view(profile, order, head_dim)
    append = lambda v, r, p, k, vv, n: pk.paged_append(v, r, p, k, vv, n, interpret=False)  # noqa: E731
    kv = _tokens(5, H, jnp.float32, head_dim)
    text = _lower(append, view, _I32, _I32, kv, kv, _I32).as_text()
    assert "__gpu$xla.gpu.triton" in text
    n_planes = len(view.layout.plane_names)
    assert len(re.findall(r"output_operand_aliases", text)) >= 1
    assert text.count("operand_tuple_indices") >= n_planes
    variants = [
        (1, pk.PagedAttentionConfig(k_splits=4)),  # decode, split context + combine
        (1, pk.PagedAttentionConfig(k_splits=1, block_k=128)),  # decode, one program per row/head
        (128, pk.PagedAttentionConfig(block_q=16)),  # chunked prefill / verify
    ]
    for t, cfg in variants:
        attn = lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, config=cfg, interpret=False)  # noqa: E731
        text = _lower(attn, _tokens(t, H * G, head_dim=head_dim), view, _I32, _I32, _I32).as_text()
        assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("profile", [p if p == "k8v4" else pytest.param(p, marks=pytest.mark.slow) for p in PROFILES])
def test_cyclic_kernels_lower_for_cuda(profile):
    view = _cyclic_view(profile)
    append = lambda v, r, p, k, vv, n: pk.cyclic_append(v, r, p, k, vv, n, interpret=False)  # noqa: E731
    _lower(append, view, _I32, _I32, _tokens(4, H), _tokens(4, H), _I32)
    for t, cfg in [(1, pk.CyclicAttentionConfig(k_splits=2)), (16, pk.CyclicAttentionConfig(block_k=32))]:
        attn = lambda q, v, r, p, n: pk.cyclic_attention(q, v, r, p, n, config=cfg, interpret=False)  # noqa: E731
        _lower(attn, _tokens(t, H * G, jnp.float32), view, _I32, _I32, _I32)


@pytest.mark.parametrize(
    "profile,order,head_dim",
    [("nvfp4-g16", "page-major", 16), ("k8v4", "head-major", 256), ("fp8-e4m3fn-row256", "head-major", 8)]
    + [pytest.param(*c, marks=pytest.mark.slow) for c in [("bf16", "page-major", 96), ("nvfp4-g16", "head-major", 160),
                                                          ("int8-g64", "page-major", 320)]],
)
def test_head_dims_lower_for_cuda(profile, order, head_dim):
    view = _paged_view(profile, order, head_dim)
    attn = lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, interpret=False)  # noqa: E731
    _lower(attn, _tokens(1, H * 8, head_dim=head_dim), view, _I32, _I32, _I32)
    append = lambda v, r, p, k, vv, n: pk.paged_append(v, r, p, k, vv, n, interpret=False)  # noqa: E731
    _lower(append, view, _I32, _I32, _tokens(64, H, head_dim=head_dim), _tokens(64, H, head_dim=head_dim), _I32)


_FORBIDDEN_OUTSIDE_KERNEL = {
    "gather", "dynamic_slice", "slice", "concatenate", "scatter", "dynamic_update_slice", "copy", "copy_p",
}


def _primitives_outside_kernels(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax_core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax_core.Jaxpr):
                    names |= _primitives_outside_kernels(sub)
    return names


@pytest.mark.parametrize("t_len,config", [(1, pk.PagedAttentionConfig(k_splits=4)), (64, pk.PagedAttentionConfig())])
def test_attention_reads_planes_only_inside_the_kernel(t_len, config):
    """No gather of a sequence into contiguous K/V and no staging copy: planes go straight to the kernel."""
    view = _paged_view("k8v4", "page-major")
    fn = lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, config=config, interpret=False)  # noqa: E731
    jaxpr = jax.make_jaxpr(fn)(_tokens(t_len, H * G), view, _I32, _I32, _I32).jaxpr
    plane_vars = set(jaxpr.invars[1 : 1 + len(view.layout.plane_names)])
    for eqn in jaxpr.eqns:
        if plane_vars & {v for v in eqn.invars if isinstance(v, jax_core.Var)}:
            assert eqn.primitive.name == "pallas_call", f"a plane is consumed by {eqn.primitive.name}"
    assert not _primitives_outside_kernels(jaxpr) & _FORBIDDEN_OUTSIDE_KERNEL


# -- 64-bit addressing of large planes -------------------------------------------------------------

_SSA_DEF = re.compile(r"^\s*(%[\w#]+)(?::\d+)? = ([\w.]+) (%[\w#]+)")
_ADDPTR = re.compile(r"= tt\.addptr (%[\w#]+), %[\w#]+ : (?:tensor<[^>]*>>|!tt\.ptr<[^>]*>), (?:tensor<[\dx]*x)?i(\d+)>?$")
_POINTER_OPS = {"tt.splat", "tt.broadcast", "tt.addptr", "tt.expand_dims", "tt.reshape"}


def _triton_modules(monkeypatch, fn, *args) -> list:
    """Lower ``fn`` for CUDA and return ``(kernel jaxpr, Triton IR text)`` of every Pallas kernel."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *a, **k):
        result = original(jaxpr, *a, **k)
        captured.append((jaxpr, result.module.operation.get_asm()))
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", capture)
    _lower(fn, *args)
    assert captured, "no Triton kernel was lowered"
    return captured


def _offset_widths_by_operand(jaxpr, text: str) -> dict[int, set[int]]:
    """For each kernel operand (``%argN``): the bit widths of the offsets added to pointers into it."""
    defs = {}
    for line in text.splitlines():
        m = _SSA_DEF.match(line)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3))
    widths: dict[int, set[int]] = {}
    for line in text.splitlines():
        m = _ADDPTR.search(line)
        if not m:
            continue
        root = m.group(1)
        while not root.startswith("%arg"):
            op, operand = defs.get(root, (None, None))
            assert op in _POINTER_OPS, f"cannot trace the pointer of {line.strip()!r} back to an operand ({root}: {op})"
            root = operand
        widths.setdefault(int(root[4:]), set()).add(int(m.group(2)))
    assert len(widths) > 0
    return widths


def _assert_wide_offsets(modules) -> int:
    """No pointer into an operand of >= 2**31 elements takes 32-bit offsets; returns how many such operands."""
    large = 0
    for jaxpr, text in modules:
        widths = _offset_widths_by_operand(jaxpr, text)
        for i, var in enumerate(jaxpr.invars):
            n = math.prod(var.aval.shape)
            if i not in widths:
                continue
            if n >= 2**31:
                large += 1
                assert widths[i] == {64}, f"operand {i} {var.aval} has {n} elements but takes i{widths[i]} offsets"
            elif n * var.aval.dtype.itemsize < 2**30:
                assert widths[i] == {32}, f"small operand {i} {var.aval} takes i{widths[i]} offsets"
    return large


# A 1-layer K8V4 pool, H = 8, D = 128, 40000 pages: the FP8 key plane holds 2.6e9 elements (2.44 GiB,
# inside the lowering's 32-bit byte window); the NVFP4 value plane 1.3e9 (i32 offsets are right).
_BIG = dict(kv_heads=8, num_pages=40000, num_layers=1)


@pytest.mark.parametrize(
    "order,config",
    [("page-major", pk.PagedAttentionConfig(k_splits=1)), ("head-major", pk.PagedAttentionConfig(block_k=128))],
)
def test_large_planes_take_64_bit_offsets_in_attention(monkeypatch, order, config):
    view = _paged_view("k8v4", order, 128, **_BIG)
    attn = lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, config=config, interpret=False)  # noqa: E731
    modules = _triton_modules(monkeypatch, attn, _tokens(1, 32), view, _I32, _I32, _I32)
    assert _assert_wide_offsets(modules) == 1  # the key plane


def test_large_planes_take_64_bit_offsets_in_append(monkeypatch):
    view = _paged_view("k8v4", "page-major", 128, **_BIG)
    append = lambda v, r, p, k, vv, n: pk.paged_append(v, r, p, k, vv, n, interpret=False)  # noqa: E731
    modules = _triton_modules(monkeypatch, append, view, _I32, _I32, _tokens(1, 8), _tokens(1, 8), _I32)
    assert _assert_wide_offsets(modules) == 1  # the key plane (written through its aliased output)


def test_the_check_sees_32_bit_offsets_without_the_wide_offset_rule(monkeypatch):
    """Control: with JAX's own offset rule (plain Triton compiler parameters) the key plane takes i32 offsets."""
    from pallas_kernels.triton import addressing
    from pallas_kernels.triton.backend import TritonBackend

    monkeypatch.setattr(addressing, "wide_offsets_supported", lambda: False)
    monkeypatch.setattr(TritonBackend, "check_planes", lambda self, planes, interpret: None)  # let the plane through
    view = _paged_view("k8v4", "page-major", 128, **_BIG)
    attn = lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, interpret=False)  # noqa: E731
    modules = _triton_modules(monkeypatch, attn, _tokens(1, 32), view, _I32, _I32, _I32)
    with pytest.raises(AssertionError, match=re.escape("takes i{32} offsets")):
        _assert_wide_offsets(modules)


def test_without_a_known_offset_rule_large_one_byte_planes_are_refused(monkeypatch):
    from pallas_kernels.triton import addressing

    monkeypatch.setattr(addressing, "wide_offsets_supported", lambda: False)
    view = _paged_view("k8v4", "page-major", 128, **_BIG)
    attn = lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, interpret=False)  # noqa: E731
    with pytest.raises(ValueError, match=r"plane 'k' of shape \(1, 40000, 8, 64, 128\) .* 2\*\*31 elements"):
        _lower(attn, _tokens(1, 32), view, _I32, _I32, _I32)
    small = _paged_view("k8v4", "page-major", 128)
    _lower(attn, _tokens(1, H * G), small, _I32, _I32, _I32)  # small planes still lower


# -- the wide-offset rule is scoped to our kernels --------------------------------------------------

_HUGE = jax.ShapeDtypeStruct((3 * 2**30,), jnp.int8)  # 3.2e9 one-byte elements, 3 GiB: JAX's rule gives i32


def _foreign(params):
    """Someone else's Pallas Triton kernel reading a huge one-byte operand (a fresh function: never cached)."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(0, 16)]

    return lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.int8), grid=(1,),
                                    compiler_params=params)(x)


def _foreign_params(wide=False):
    from jax.experimental.pallas import triton as pl_triton

    from pallas_kernels.triton.addressing import WideOffsetParams

    return (WideOffsetParams if wide else pl_triton.CompilerParams)(num_warps=1, num_stages=1)


def _foreign_kernel(monkeypatch, params) -> tuple[str, set[int]]:
    """The Triton IR of the foreign kernel and the offset widths into its huge operand."""
    [(jaxpr, text)] = _triton_modules(monkeypatch, _foreign(params), _HUGE)
    return text, _offset_widths_by_operand(jaxpr, text)[0]


def test_the_wide_offset_rule_leaves_other_kernels_alone(monkeypatch):
    from jax._src.pallas.triton import lowering

    original = lowering._compute_offsets_from_indices
    before, widths = _foreign_kernel(monkeypatch, _foreign_params())
    assert widths == {32}
    # Our kernel, lowered in the same process, addresses its large plane with 64-bit offsets ...
    view = _paged_view("k8v4", "page-major", 128, **_BIG)
    attn = lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, interpret=False)  # noqa: E731
    assert _assert_wide_offsets(_triton_modules(monkeypatch, attn, _tokens(1, 32), view, _I32, _I32, _I32)) == 1
    # ... and leaves nothing behind: the other kernel lowers to the same program as before.
    after, _ = _foreign_kernel(monkeypatch, _foreign_params())
    assert after == before
    assert lowering._compute_offsets_from_indices is original
    # Control: under our rule (our compiler parameters) the same kernel would take 64-bit offsets.
    wide, widths = _foreign_kernel(monkeypatch, _foreign_params(wide=True))
    assert widths == {64} and wide != before


def test_a_kernel_lowered_by_another_thread_during_ours_keeps_jax_offsets(monkeypatch):
    """While our kernel is being lowered (the wrapper installed), another thread lowers someone else's
    kernel: it gets JAX's own offsets, ours the wide ones."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    from pallas_kernels.triton.addressing import WideOffsetParams

    original, inner = lowering._compute_offsets_from_indices, pallas_call_registration.pallas_call_lowering
    meanwhile = []

    def ours_then_another(ctx, *in_nodes, **params):
        if isinstance(params["compiler_params"], WideOffsetParams) and not meanwhile:
            assert lowering._compute_offsets_from_indices is not original  # inside our rule: the wrapper is in
            thread = threading.Thread(target=lambda: meanwhile.append(_lower(_foreign(_foreign_params()), _HUGE)))
            thread.start()
            thread.join()
        return inner(ctx, *in_nodes, **params)

    monkeypatch.setattr(pallas_call_registration, "pallas_call_lowering", ours_then_another)
    view = _paged_view("k8v4", "page-major", 128, **_BIG)
    attn = lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, interpret=False)  # noqa: E731
    (foreign_jaxpr, foreign_text), ours = _triton_modules(monkeypatch, attn, _tokens(1, 32), view, _I32, _I32, _I32)
    assert meanwhile, "the other thread lowered nothing"
    assert _offset_widths_by_operand(foreign_jaxpr, foreign_text)[0] == {32}
    assert _assert_wide_offsets([ours]) == 1
    assert lowering._compute_offsets_from_indices is original
