"""Every kernel variant lowers for CUDA on this CPU machine (interpret=False, Triton lowering).

The Pallas interpreter accepts programs the Triton lowering rejects (``round``, slicing loaded
values, f8 constants ...), so this is a test of its own.  Lowering stops before PTX: it proves
the kernels are expressible in Triton IR, not that they are fast or run on a given GPU.

Also checked on the lowered (CUDA) programs: the planes are consumed by the kernel only (no
gather, slice or staging copy of them outside it) and the append aliases them input -> output.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jax_core

import pallas_cases as pc
import pallas_kernels as pk
from ninfer_kv.layout import PagedKVStorageLayout
from ninfer_kv.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView

B, H, G, D, N_PAGES, WIDTH = 3, 2, 4, 128, 16, 8


def _paged_view(profile, order, head_dim=D):
    lay = PagedKVStorageLayout(profile, 2, H, head_dim, order)
    planes = {n: jax.ShapeDtypeStruct(s, lay.plane_dtypes()[n]) for n, s in lay.plane_shapes(N_PAGES).items()}
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


@pytest.mark.parametrize("order", pc.ORDERS)
@pytest.mark.parametrize("profile", pc.PROFILES)
def test_paged_kernels_lower_for_cuda(profile, order):
    view = _paged_view(profile, order)
    append = lambda v, r, p, k, vv, n: pk.paged_append(v, r, p, k, vv, n, interpret=False)  # noqa: E731
    text = _lower(append, view, _I32, _I32, _tokens(5, H, jnp.float32), _tokens(5, H, jnp.float32), _I32).as_text()
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
        text = _lower(attn, _tokens(t, H * G), view, _I32, _I32, _I32).as_text()
        assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("profile", pc.PROFILES)
def test_cyclic_kernels_lower_for_cuda(profile):
    view = _cyclic_view(profile)
    append = lambda v, r, p, k, vv, n: pk.cyclic_append(v, r, p, k, vv, n, interpret=False)  # noqa: E731
    _lower(append, view, _I32, _I32, _tokens(4, H), _tokens(4, H), _I32)
    for t, cfg in [(1, pk.CyclicAttentionConfig(k_splits=2)), (16, pk.CyclicAttentionConfig(block_k=32))]:
        attn = lambda q, v, r, p, n: pk.cyclic_attention(q, v, r, p, n, config=cfg, interpret=False)  # noqa: E731
        _lower(attn, _tokens(t, H * G, jnp.float32), view, _I32, _I32, _I32)


@pytest.mark.parametrize("profile,head_dim", [("int8-g64", 64), ("nvfp4-g16", 256), ("k8v4", 256), ("bf16", 64)])
def test_head_dims_lower_for_cuda(profile, head_dim):
    view = _paged_view(profile, "page-major", head_dim)
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
