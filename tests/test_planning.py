"""Capacity planning: M range, explicit and automatic policies, backend pools, the capacity curve."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.planning import MAX_CONTEXT, MAX_PAGES, PlanBoundError, check_pool_bytes
from ninfer_kv.schema.sizes import INT64_MAX
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.planning import AutomaticCapacity, ExplicitCapacity, KVPoolSetLayout, ModelKVConfig, SequenceCapacityCurve, SpeculativeConfig, plan_kv_cache
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.schema.geometry import PlaneOrder
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.device.allocation import allocate_pools, allocated_pool_bytes

P = 64
TINY = ModelKVConfig(num_layers=1, num_kv_heads=1, head_dim=64, profile="bf16")
TINY_PAGE = 2 * 64 * 2 * 64  # (K + V) bf16 bytes * D * P = 16384


def _plan(model=TINY, *, s, c, policy, spec=None, fixed=0):
    return plan_kv_cache(model, max_context=s, max_concurrency=c, policy=policy, speculative=spec, fixed_bytes=fixed)


# -- M range --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "s, c, l, m_min, m_max",
    [
        (32768, 64, 512, 512, 32768),  # L > C
        (128, 4, 2, 4, 8),  # C > L
        (100, 3, 2, 3, 6),  # S not a multiple of P
        (64, 1, 1, 1, 1),
        (4096, 1, 64, 64, 64),  # C = 1: a single point
        (64, 5, 1, 5, 5),  # L = 1: a single point
    ],
)
def test_m_range(s, c, l, m_min, m_max):
    b = KVPoolSetLayout(TINY, s, c)
    assert (b.logical_pages, b.m_min, b.m_max) == (l, m_min, m_max)


@pytest.mark.parametrize("policy", [ExplicitCapacity(4096), AutomaticCapacity(free_bytes=10**9)])
def test_single_point_m_min_equals_m_max(policy):
    plan = _plan(s=4096, c=1, policy=policy)
    assert plan.m == plan.pool_set.m_min == plan.pool_set.m_max == 64
    assert plan.capacity_tokens == 4096
    assert plan.device_bytes == plan.curve.b_min == 64 * TINY_PAGE + 64 * 4


def test_single_point_automatic_still_requires_b_min():
    b = KVPoolSetLayout(TINY, 4096, 1)
    need = b.curve().b_min
    assert _plan(s=4096, c=1, policy=AutomaticCapacity(free_bytes=need)).m == 64
    with pytest.raises(ValueError, match=f"free_bytes={need - 1} is too small.*{need}"):
        _plan(s=4096, c=1, policy=AutomaticCapacity(free_bytes=need - 1))


# -- explicit policy ------------------------------------------------------------------------------
def test_explicit_rounds_up_to_pages():
    # S = 1000, C = 8: L = 16, M_min = 16, M_max = 128.
    assert _plan(s=1000, c=8, policy=ExplicitCapacity(1000)).m == 16
    assert _plan(s=1000, c=8, policy=ExplicitCapacity(1025)).m == 17
    assert _plan(s=1000, c=8, policy=ExplicitCapacity(128 * 64)).m == 128


def test_explicit_below_max_context_is_rejected_with_range():
    with pytest.raises(ValueError) as err:
        _plan(s=1000, c=8, policy=ExplicitCapacity(999))
    msg = str(err.value)
    assert "kv_capacity=999" in msg and "[1000, 8192] tokens" in msg


def test_explicit_below_m_min_is_rejected_even_when_at_least_s():
    # S = 128, C = 4: L = 2 but M_min = C = 4, so at least 3 * 64 + 1 tokens are needed.
    with pytest.raises(ValueError, match=r"kv_capacity=192 is out of range; it must be in \[193, 512\] tokens"):
        _plan(s=128, c=4, policy=ExplicitCapacity(192))
    assert _plan(s=128, c=4, policy=ExplicitCapacity(193)).m == 4


def test_explicit_above_m_max_is_rejected_with_range():
    with pytest.raises(ValueError, match=r"kv_capacity=8193 is out of range; it must be in \[1000, 8192\] tokens"):
        _plan(s=1000, c=8, policy=ExplicitCapacity(8193))


def test_m_outside_range_is_rejected_by_the_pool_set():
    b = KVPoolSetLayout(TINY, 1000, 8)
    for m in (15, 129):
        with pytest.raises(ValueError, match=r"M=%d Main pages is outside \[16, 128\]" % m):
            b.pools(m)
        with pytest.raises(ValueError, match=r"outside"):
            b.curve().bytes_at(m)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_policy_arguments_are_validated(bad):
    with pytest.raises(ValueError, match="kv_capacity="):
        ExplicitCapacity(bad)
    if bad != 0:
        with pytest.raises(ValueError, match="free_bytes="):
            AutomaticCapacity(free_bytes=bad)
        with pytest.raises(ValueError, match="headroom_bytes="):
            AutomaticCapacity(free_bytes=10, headroom_bytes=bad)


# -- automatic policy -----------------------------------------------------------------------------
def test_automatic_policy_by_hand():
    # TINY model, S = 128, C = 4: L = 2, M_min = 4, M_max = 8, one bf16 pool of 16384 B per page,
    # one 4 x 2 int32 table (32 B), fixed part 1000 B.
    b_min = 4 * TINY_PAGE + 32 + 1000
    assert b_min == 66568
    spec = dict(s=128, c=4, fixed=1000)
    curve = _plan(policy=ExplicitCapacity(256), **spec).curve
    assert (curve.b_min, curve.b_step) == (66568, 16384)
    R = 5000
    cases = [
        (R + b_min, 4),  # exactly B_min: M_min
        (R + b_min + 16383, 4),  # one byte short of a page
        (R + b_min + 2 * 16384, 6),
        (R + b_min + 3 * 16384 + 7, 7),
        (R + b_min + 4 * 16384, 8),  # exactly M_max
        (10**12, 8),  # clamped to M_max
    ]
    for free, m in cases:
        plan = _plan(policy=AutomaticCapacity(free_bytes=free, headroom_bytes=R), **spec)
        assert plan.m == m == min(8, 4 + (free - R - b_min) // 16384)
        assert plan.device_bytes == b_min + (m - 4) * 16384 <= free - R


def test_automatic_rejects_free_below_headroom_plus_b_min():
    b_min = 4 * TINY_PAGE + 32
    with pytest.raises(ValueError) as err:
        _plan(s=128, c=4, policy=AutomaticCapacity(free_bytes=b_min + 99, headroom_bytes=100))
    msg = str(err.value)
    assert f"free_bytes={b_min + 99}" in msg and f"100 + {b_min} = {b_min + 100}" in msg


def test_realistic_plan_by_hand():
    # 16 layers, 2 KV heads, D = 256, K8V4 (402 B per token-head), S = 32768, C = 64, MTP K = 4, F = 40 GiB.
    model = ModelKVConfig(16, 2, 256, "k8v4")
    spec = SpeculativeConfig("mtp", draft_window=4)
    plan = _plan(model, s=32768, c=64, policy=AutomaticCapacity(free_bytes=40 * 2**30), spec=spec)
    main_page, mtp_page = 402 * 2 * 16 * 64, 402 * 2 * 1 * 64
    assert (main_page, mtp_page) == (823296, 51456)
    table = 64 * 512 * 4
    b_min = 512 * main_page + (512 + 64) * mtp_page + 2 * table
    assert (plan.curve.b_min, plan.curve.b_step) == (b_min, main_page + mtp_page) == (451428352, 874752)
    assert plan.m == min(32768, 512 + (40 * 2**30 - b_min) // 874752) == 32768
    js = plan.to_json()
    assert js["pools"]["mtp"]["physical_pages"] == 32768 + 64
    assert js["capacity_tokens"] == 32768 * 64
    assert js["device_bytes"] == b_min + (32768 - 512) * 874752 == 28667428864
    # With 10 GiB free the policy lands strictly inside the range.
    plan = _plan(model, s=32768, c=64, policy=AutomaticCapacity(free_bytes=10 * 2**30), spec=spec)
    assert plan.m == 512 + (10 * 2**30 - b_min) // 874752 == 12270


# -- pool set and backend pages -------------------------------------------------------------------
@pytest.mark.parametrize("k, lead", [(1, 0), (2, 1), (4, 1), (64, 1), (65, 1), (66, 2), (130, 3)])
def test_mtp_lead_pages(k, lead):
    c = 3
    spec = SpeculativeConfig("mtp", draft_window=k, mtp_layers=2)
    plan = _plan(s=1000, c=c, policy=ExplicitCapacity(2000), spec=spec)
    assert lead == math.ceil((k - 1) / 64)
    assert tuple(plan.pools) == (PoolKind.MAIN, PoolKind.MTP)
    assert plan.pools[PoolKind.MAIN].physical_pages == plan.m == 32
    assert plan.pools[PoolKind.MTP].physical_pages == plan.m + lead * c
    mtp = plan.pools[PoolKind.MTP].layout
    assert (mtp.profile, mtp.order, mtp.num_layers) == (KVProfile.BF16, PlaneOrder.PAGE_MAJOR, 2)
    # The lead pages are a constant in B(M): they are part of B_min, not of B_step.
    assert plan.curve.b_step == plan.pools[PoolKind.MAIN].page_bytes + plan.pools[PoolKind.MTP].page_bytes


def test_mtp_uses_the_main_profile_and_geometry():
    model = ModelKVConfig(4, 2, 128, "nvfp4-g16")
    plan = _plan(model, s=256, c=2, policy=ExplicitCapacity(512), spec=SpeculativeConfig("mtp", draft_window=4))
    mtp = plan.pools[PoolKind.MTP].layout
    assert (mtp.profile, mtp.num_kv_heads, mtp.head_dim, mtp.num_layers) == (KVProfile.NVFP4_G16, 2, 128, 1)


@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_dflash_without_full_layers_has_main_only(backend):
    plan = _plan(s=256, c=2, policy=ExplicitCapacity(512), spec=SpeculativeConfig(backend))
    assert tuple(plan.pools) == (PoolKind.MAIN,)
    assert "draft_full" not in plan.to_json()["pools"]


@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_dflash_with_full_layers_adds_a_bf16_head_major_pool(backend):
    model = ModelKVConfig(3, 2, 128, "k8v4")
    spec = SpeculativeConfig(backend, draft_full_layers=2, draft_kv_heads=4, draft_head_dim=96)
    plan = _plan(model, s=256, c=2, policy=ExplicitCapacity(400), spec=spec)
    assert tuple(plan.pools) == (PoolKind.MAIN, PoolKind.DRAFT_FULL)
    draft = plan.pools[PoolKind.DRAFT_FULL]
    lay = draft.layout
    assert (lay.profile, lay.order, lay.num_layers, lay.num_kv_heads, lay.head_dim) == (
        KVProfile.BF16,
        PlaneOrder.HEAD_MAJOR,
        2,
        4,
        96,
    )
    assert draft.physical_pages == plan.m == 7
    assert lay.plane_shape("k", draft.physical_pages) == (2, 4, 7, 64, 96)
    assert draft.page_bytes == 2 * 96 * 2 * 4 * 2 * 64
    assert plan.to_json()["pools"]["draft_full"]["order"] == "head-major"


def test_draft_geometry_defaults_to_the_main_model():
    model = ModelKVConfig(3, 2, 128, "int8-g64")
    plan = _plan(model, s=256, c=2, policy=ExplicitCapacity(400), spec=SpeculativeConfig("dflash", draft_full_layers=1))
    lay = plan.pools[PoolKind.DRAFT_FULL].layout
    assert (lay.num_kv_heads, lay.head_dim, lay.profile) == (2, 128, KVProfile.BF16)


def test_off_backend_has_main_only():
    plan = _plan(s=256, c=2, policy=ExplicitCapacity(512), spec=SpeculativeConfig("off", draft_window=9))
    assert tuple(plan.pools) == (PoolKind.MAIN,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(method="eagle"), "unknown speculative method 'eagle'"),
        (dict(method="mtp", draft_window=0), "draft_window=0"),
        (dict(method="mtp", mtp_layers=0), "mtp_layers=0"),
        (dict(method="dflash", draft_full_layers=-1), "draft_full_layers=-1"),
        (dict(method="dflash", draft_kv_heads=0), "draft_kv_heads=0"),
        (dict(method="dflash", draft_head_dim=0), "draft_head_dim=0"),
    ],
)
def test_bad_speculative_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1, 64, "bf16"), "num_layers=0"),
        ((1, 0, 64, "bf16"), "num_kv_heads=0"),
        ((1, 1, 96, "int8-g64"), "int8-g64: head_dim=96"),
        ((1, 1, 40, "nvfp4-g16"), "nvfp4-g16: head_dim=40"),
        ((1, 1, 64, "fp16"), "unknown KV profile"),
    ],
)
def test_bad_model_config(args, match):
    with pytest.raises(ValueError, match=match):
        ModelKVConfig(*args)


def test_bad_engine_shape():
    with pytest.raises(ValueError, match="max_context=0"):
        KVPoolSetLayout(TINY, 0, 1)
    with pytest.raises(ValueError, match="max_concurrency=0"):
        KVPoolSetLayout(TINY, 64, 0)
    with pytest.raises(ValueError, match="fixed_bytes=-1"):
        KVPoolSetLayout(TINY, 64, 1, fixed_bytes=-1)


# -- capacity curve against the real buffers ------------------------------------------------------
CURVE_CASES = [
    ("off", ModelKVConfig(2, 2, 64, "k8v4"), SpeculativeConfig()),
    ("mtp-k65", ModelKVConfig(2, 1, 64, "int8-g64"), SpeculativeConfig("mtp", draft_window=65, mtp_layers=2)),
    ("dflash-full", ModelKVConfig(2, 2, 32, "nvfp4-g16"), SpeculativeConfig("dflash", draft_full_layers=1, draft_kv_heads=1, draft_head_dim=48)),
    ("dflash2-full", ModelKVConfig(1, 1, 64, "fp8-e4m3fn-row256"), SpeculativeConfig("dflash2", draft_full_layers=2)),
]


@pytest.mark.parametrize("name, model, spec", CURVE_CASES, ids=[c[0] for c in CURVE_CASES])
def test_curve_matches_really_allocated_buffers(name, model, spec):
    pool_set = KVPoolSetLayout(model, max_context=300, max_concurrency=3, speculative=spec, fixed_bytes=777)
    assert (pool_set.m_min, pool_set.m_max) == (5, 15)
    curve = pool_set.curve()
    for m in (pool_set.m_min, 9, pool_set.m_max):
        real = allocated_pool_bytes(pool_set, m)
        assert real == curve.bytes_at(m) == pool_set.device_bytes(m)
        assert real == sum(p.bytes + p.table_bytes for p in pool_set.pools(m).values()) + 777
    planes = allocate_pools(pool_set, pool_set.m_min)
    assert set(planes) == set(pool_set.pool_kinds)
    for kind, pool in pool_set.pools(pool_set.m_min).items():
        assert {n: a.shape for n, a in planes[kind].items()} == pool.layout.plane_shapes(pool.physical_pages)


def test_curve_detects_a_wrong_curve():
    pool_set = KVPoolSetLayout(TINY, 300, 3)
    good = pool_set.curve()
    bad = SequenceCapacityCurve(good.m_min, good.m_max, good.b_min, good.b_step - 1)
    pool_set.verify_curve(good, range(good.m_min, good.m_max + 1))
    with pytest.raises(AssertionError, match="capacity curve mismatch at M=6"):
        pool_set.verify_curve(bad, [good.m_min, good.m_min + 1])


@settings(max_examples=40, deadline=None)
@given(
    profile=st.sampled_from(list(KVProfile)),
    layers=st.integers(1, 4),
    heads=st.integers(1, 4),
    groups=st.integers(1, 4),
    s=st.integers(1, 5000),
    c=st.integers(1, 40),
    backend=st.sampled_from(["off", "mtp", "dflash", "dflash2"]),
    k=st.integers(1, 200),
    full=st.integers(0, 2),
    fixed=st.integers(0, 10**6),
    slack=st.integers(0, 10**9),
    headroom=st.integers(0, 10**6),
)
def test_automatic_m_is_the_largest_affordable(profile, layers, heads, groups, s, c, backend, k, full, fixed, slack, headroom):
    model = ModelKVConfig(layers, heads, 64 * groups, profile)
    spec = SpeculativeConfig(backend, draft_window=min(k, s), draft_full_layers=full)
    pool_set = KVPoolSetLayout(model, s, c, spec, fixed)
    curve = pool_set.curve()
    free = headroom + curve.b_min + slack
    plan = _plan(model, s=s, c=c, policy=AutomaticCapacity(free, headroom), spec=spec, fixed=fixed)
    m = plan.m
    assert pool_set.m_min <= m <= pool_set.m_max
    assert pool_set.device_bytes(m) == plan.device_bytes <= free - headroom
    assert m == pool_set.m_max or pool_set.device_bytes(m + 1) > free - headroom
    # Published capacity is M * P; the per-sequence ceiling stays S.
    assert plan.capacity_tokens == m * P
    assert plan.max_context == s and plan.logical_pages == math.ceil(s / P)
    assert plan.to_json()["max_context"] == s


def test_capacity_tokens_never_raise_s():
    plan = _plan(s=100, c=1, policy=ExplicitCapacity(100))
    assert plan.m == 2 and plan.capacity_tokens == 128
    assert plan.max_context == 100
    assert plan.pools[PoolKind.MAIN].table_shape == (1, 2)


def test_plan_json_keys():
    spec = SpeculativeConfig("mtp", draft_window=4)
    js = _plan(s=256, c=2, policy=ExplicitCapacity(512), spec=spec).to_json()
    for key in ("page_size", "logical_pages", "m_min", "m_max", "main_pages", "capacity_tokens", "pools", "curve", "device_bytes"):
        assert key in js
    assert set(js["pools"]) == {"main", "mtp"}
    for pool in js["pools"].values():
        assert set(pool) == {"profile", "order", "layers", "kv_heads", "head_dim", "physical_pages", "page_bytes", "bytes", "table_bytes"}
    assert set(js["curve"]) == {"b_min", "b_step"}


# -- bounds: exact integers, int32 page IDs and positions, int64 bytes ------------------------------
def test_huge_geometry_has_an_exact_curve_and_a_bound_error():
    # Once overflowed int64 inside the pool set ("capacity curve mismatch"); the bytes are exact ints.
    model = ModelKVConfig(4096, 1000, 65536, "bf16")
    pool_set = KVPoolSetLayout(model, 100_000_000, 100_000)
    curve = pool_set.curve()  # verified against the pool set at M_max
    page = 4096 * 1000 * 65536 * 2 * 2 * P
    assert curve.b_step == page and curve.b_min == pool_set.m_min * page + pool_set.m_max * 4
    assert pool_set.device_bytes(pool_set.m_max) == curve.bytes_at(pool_set.m_max) > INT64_MAX
    with pytest.raises(PlanBoundError, match="B_min=.* must fit int64") as err:
        _plan(model, s=100_000_000, c=100_000, policy=ExplicitCapacity(100_000_000))
    assert err.value.name == "B_min" and isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "kwargs, name, allowed",
    [
        (dict(s=MAX_CONTEXT + 1, c=1), "max_context", f"[1, {MAX_CONTEXT}]"),
        (dict(s=64, c=MAX_PAGES), "max_concurrency", f"[1, {MAX_PAGES - 1}]"),
        (dict(s=64, c=MAX_PAGES // 2, spec=SpeculativeConfig("mtp", draft_window=64)), "max_concurrency",
         f"[1, {MAX_PAGES // 2}]"),
        (dict(s=64, c=MAX_PAGES // 2 + 1, spec=SpeculativeConfig("mtp", draft_window=64)), "max_concurrency",
         f"[1, {MAX_PAGES // 2}]"),
        (dict(s=100, c=1, spec=SpeculativeConfig("mtp", draft_window=101)), "draft_window", "[1, 100]"),
    ],
)
def test_pool_set_bounds(kwargs, name, allowed):
    spec = kwargs.pop("spec", None)
    if name == "max_concurrency" and kwargs["c"] == MAX_PAGES // 2:
        assert KVPoolSetLayout(TINY, kwargs["s"], kwargs["c"], spec).max_m() == MAX_PAGES // 2
        return
    with pytest.raises(PlanBoundError) as err:
        KVPoolSetLayout(TINY, kwargs["s"], kwargs["c"], spec)
    assert err.value.name == name and allowed in str(err.value)


def test_m_is_bounded_by_int32_page_ids():
    # S = 6400 (L = 100), C = 2**30: M_max = 100 * 2**30 pages, but page IDs stop at 2**31.
    pool_set = KVPoolSetLayout(TINY, 6400, 2**30)
    assert pool_set.max_m() == MAX_PAGES < pool_set.m_max
    assert _plan(s=6400, c=2**30, policy=ExplicitCapacity(MAX_PAGES * P)).m == MAX_PAGES
    with pytest.raises(PlanBoundError, match=r"kv_capacity=.* it must be in \[.*, %d\] tokens.*int32" % (MAX_PAGES * P)):
        _plan(s=6400, c=2**30, policy=ExplicitCapacity(MAX_PAGES * P + 1))
    with pytest.raises(PlanBoundError, match="free_bytes=.*at most .* bytes for this plan.*int32") as err:
        _plan(s=6400, c=2**30, policy=AutomaticCapacity(free_bytes=INT64_MAX))
    assert err.value.name == "free_bytes"
    with pytest.raises(PlanBoundError, match="M=.*int32"):
        pool_set.check_bounds(MAX_PAGES + 1)


def test_byte_counts_must_fit_int64():
    with pytest.raises(PlanBoundError, match="free_bytes="):
        AutomaticCapacity(free_bytes=INT64_MAX + 1)
    with pytest.raises(PlanBoundError, match="fixed_bytes="):
        KVPoolSetLayout(TINY, 64, 1, fixed_bytes=INT64_MAX + 1)
    with pytest.raises(PlanBoundError, match="B_min=.*fixed_bytes=.*int64"):
        _plan(s=64, c=1, policy=ExplicitCapacity(64), fixed=INT64_MAX)


@pytest.mark.parametrize(
    "args, name",
    [((4097, 1, 64), "num_layers"), ((1, 65537, 64), "num_kv_heads"), ((1, 1, 10**12), "head_dim")],
)
def test_model_geometry_is_bounded(args, name):
    with pytest.raises(PlanBoundError, match=f"{name}=") as err:
        ModelKVConfig(*args, "bf16")
    assert err.value.name == name


def test_pool_bytes_are_exact_and_bounded():
    layout = PagedKVStorageLayout("bf16", 4096, 65536, 65536)
    assert layout.page_bytes == 2**52 and layout.buffer_bytes(2047) == 2047 * 2**52  # no int64 wrap
    assert check_pool_bytes(layout, 2047) == 2047 * 2**52
    with pytest.raises(PlanBoundError, match=r"num_pages=2048 .*\[1, 2047\]"):
        check_pool_bytes(layout, 2048)
    with pytest.raises(PlanBoundError, match="num_pages=.*int32"):
        check_pool_bytes(PagedKVStorageLayout("bf16", 1, 1, 64), MAX_PAGES + 1)
