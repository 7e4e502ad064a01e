"""Kernel configs, Triton compiler knobs and static limits: clear errors, sensible resolution."""

import dataclasses

import pytest

import pallas_kernels as pk
from ninfer_kv.schema.profiles import KVProfile
from pallas_kernels.triton.config import query_rows


@pytest.mark.parametrize(
    "cls,field,value",
    [
        (pk.PagedAppendConfig, "block_t", 3),
        (pk.PagedAppendConfig, "block_t", 0),
        (pk.TritonConfig, "num_warps", 6),
        (pk.TritonConfig, "num_stages", 0),
        (pk.PagedAttentionConfig, "block_k", 32),  # below one page
        (pk.PagedAttentionConfig, "block_k", 96),
        (pk.PagedAttentionConfig, "block_q", 5),
        (pk.PagedAttentionConfig, "k_splits", 0),
        (pk.CyclicAttentionConfig, "block_k", 8),
    ],
)
def test_invalid_config_names_field_and_range(cls, field, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}={value}.*\["):
        cls(**{field: value})


def test_configs_are_frozen_and_hashable():
    cfg = pk.PagedAttentionConfig(block_q=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_q = 8
    assert hash(cfg) == hash(pk.PagedAttentionConfig(block_q=4))
    assert pk.CyclicAttentionConfig(block_k=16).block_k == 16


def test_resolve_decode_and_chunk():
    # Decode: one query token, GQA 4 padded to 16 rows; a small batch gets context splits.
    r = pk.PagedAttentionConfig().resolve(num_queries=1, group=4, head_dim=128, batch=2, kv_heads=2, max_keys=64 * 512)
    assert (r.block_q, query_rows(r.block_q, 4), pk.TritonConfig().for_attention(128, 16)) == (1, 16, pk.TritonConfig(4, 2))
    assert r.k_splits > 1
    # A big batch needs no split.
    r = pk.PagedAttentionConfig().resolve(num_queries=1, group=4, head_dim=256, batch=64, kv_heads=8, max_keys=64 * 128)
    assert (r.k_splits, pk.TritonConfig(num_stages=4).for_attention(256, 16)) == (1, pk.TritonConfig(8, 4))
    # A decode tile of head dim > 128 pipelines three key steps; a chunk tile two.
    assert pk.TritonConfig().for_attention(256, 16) == pk.TritonConfig(8, 3)
    assert pk.TritonConfig().for_attention(256, 64) == pk.TritonConfig(8, 2)
    assert pk.TritonConfig().for_attention(128, 16) == pk.TritonConfig(4, 2)
    assert pk.TritonConfig().for_attention(128, 128) == pk.TritonConfig(8, 2)  # a 128-row chunk tile
    # Chunk: 64 rows per program; explicit splits are capped by the number of key steps.
    r = pk.PagedAttentionConfig(k_splits=100).resolve(
        num_queries=128, group=4, head_dim=128, batch=1, kv_heads=1, max_keys=256
    )
    assert (r.block_q, query_rows(r.block_q, 4), r.k_splits) == (16, 64, 4)
    assert pk.TritonConfig(num_warps=2).for_append() == pk.TritonConfig(2, 1)


def test_resolve_rejects_too_many_rows():
    with pytest.raises(ValueError, match="query rows"):
        pk.PagedAttentionConfig(block_q=64).resolve(
            num_queries=64, group=8, head_dim=128, batch=1, kv_heads=1, max_keys=64
        )


@pytest.mark.parametrize("profile,head_dim", [("bf16", 1024), ("bf16", 0), ("nvfp4-g16", 24), ("int8-g64", 96)])
def test_unsupported_head_dims_are_clear(profile, head_dim):
    with pytest.raises(ValueError, match=rf"head_dim={head_dim}"):
        pk.check_head_dim(KVProfile.parse(profile), head_dim)


@pytest.mark.parametrize("profile,head_dim", [("bf16", 80), ("fp8-e4m3fn-row256", 96), ("nvfp4-g16", 16),
                                              ("int8-g64", 192), ("k8v4", 160), ("bf16", 8)])
def test_every_codec_head_dim_is_accepted(profile, head_dim):
    pk.check_head_dim(KVProfile.parse(profile), head_dim)


def test_another_backends_compiler_knobs_are_clear():
    import jax.numpy as jnp

    from tests.conformance.cases import make_paged_case

    @dataclasses.dataclass(frozen=True)
    class MosaicKnobs:
        dimension_semantics: tuple = ()

    case = make_paged_case("bf16", "page-major", kv_lens=[10], heads=1)
    view, rows = case.view(), jnp.asarray(case.table_rows)
    q = jnp.zeros((1, 1, 1, 64), jnp.float32)
    i32 = jnp.zeros((1,), jnp.int32)
    with pytest.raises(TypeError, match=r"PagedAttentionConfig.compiler must be a TritonConfig or None .*MosaicKnobs"):
        pk.paged_attention(q, view, rows, i32, i32, config=pk.PagedAttentionConfig(compiler=MosaicKnobs()))
    with pytest.raises(TypeError, match=r"PagedAppendConfig.compiler must be a TritonConfig"):
        pk.paged_append(view, rows, i32, q, q, i32, config=pk.PagedAppendConfig(compiler=MosaicKnobs()))


def test_every_op_has_a_triton_implementation():
    from ninfer_kv.ops import registry

    ops = {op for op, backend in registry.registered_ops() if backend == "pallas"}
    assert ops == {"paged_append", "paged_attention", "cyclic_append", "cyclic_attention", "paged_append_ragged",
                   "paged_attention_ragged"}


def test_empty_batches_and_chunks_run_no_kernel():
    import jax.numpy as jnp
    import numpy as np

    from tests.conformance.cases import make_paged_case
    from tests.conformance.checks import assert_same_planes

    case = make_paged_case("k8v4", "page-major", kv_lens=[10], heads=1, poison="bytes")
    view, rows = case.view(), jnp.asarray(case.table_rows)
    q = jnp.zeros((1, 0, 2, 64), jnp.bfloat16)
    i32 = jnp.zeros((1,), jnp.int32)
    out = pk.paged_attention(q, view, rows, i32, i32)
    assert out.shape == q.shape and out.dtype == q.dtype
    k = jnp.zeros((1, 0, 1, 64), jnp.float32)
    after = pk.paged_append(view, rows, i32, k, k, i32)
    assert_same_planes({n: np.asarray(x) for n, x in after.planes.items()}, case.planes, "empty chunk")


def test_ops_reject_the_other_ops_config():
    import jax.numpy as jnp

    from tests.conformance.cases import make_paged_case

    case = make_paged_case("bf16", "page-major", kv_lens=[10], heads=1)
    view, rows = case.view(), jnp.asarray(case.table_rows)
    q = jnp.zeros((1, 1, 1, 64), jnp.float32)
    i32 = jnp.zeros((1,), jnp.int32)
    with pytest.raises(TypeError, match="PagedAttentionConfig"):
        pk.paged_attention(q, view, rows, i32, i32, config=pk.CyclicAttentionConfig(block_k=16))
    with pytest.raises(TypeError, match="PagedAppendConfig"):
        pk.paged_append(view, rows, i32, q, q, i32, config=pk.CyclicAppendConfig())
