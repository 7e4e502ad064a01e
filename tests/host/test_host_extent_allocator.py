"""ExtentAllocator: best fit, coalescing, byte-exact accounting, stale handles, plan validation."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.host import (
    ExtentAllocationError,
    ExtentAllocator,
    InvalidPlanError,
    StaleExtentError,
)

A = 256  # alignment


def test_accounting_is_byte_exact_and_padding_separate():
    alloc = ExtentAllocator(16 * A, A)
    e1 = alloc.allocate(300, "main")  # span 512
    e2 = alloc.allocate(256, "mtp")  # span 256
    e3 = alloc.allocate(1, "main")  # span 256
    assert [e.offset for e in (e1, e2, e3)] == [0, 512, 768]
    assert (e1.span, e2.span, e3.span) == (512, 256, 256)
    occ = alloc.occupancy()
    assert occ.used_bytes == 300 + 256 + 1
    assert occ.padding_bytes == (512 - 300) + 0 + (256 - 1)
    assert occ.used_bytes + occ.padding_bytes + occ.free_bytes == occ.capacity == 16 * A
    assert occ.extent_count == 3 and occ.free_extent_count == 1
    assert occ.largest_free_extent == occ.free_bytes == 16 * A - 1024
    assert occ.fragmentation == 0.0
    assert occ.tags["main"].used_bytes == 301 and occ.tags["main"].extent_count == 2
    assert occ.tags["main"].padding_bytes == 212 + 255
    assert occ.tags["mtp"].used_bytes == 256 and occ.tags["mtp"].padding_bytes == 0
    assert occ.to_json()["tags"]["mtp"]["extent_count"] == 1
    alloc.audit_invariants()


def test_best_fit_picks_smallest_hole_and_free_coalesces():
    alloc = ExtentAllocator(16 * A, A)
    ext = [alloc.allocate(A * n) for n in (3, 1, 2, 1, 5)]  # offsets 0,3,4,6,7 (units of A), 4 free at 12
    alloc.free(ext[0])  # hole of 3 at 0
    alloc.free(ext[2])  # hole of 2 at 4
    small = alloc.allocate(2 * A)
    assert small.offset == 4 * A  # the 2-unit hole, not the 3-unit one or the tail
    alloc.free(small)
    alloc.free(ext[1])  # merges 0..3 (3) + 3 (1) + 4..6 (2) into one hole of 6
    assert alloc.free_extents() == [(0, 6 * A), (12 * A, 4 * A)]
    alloc.free(ext[3])
    assert alloc.free_extents() == [(0, 7 * A), (12 * A, 4 * A)]
    occ = alloc.occupancy()
    assert occ.largest_free_extent == 7 * A and occ.free_bytes == 11 * A
    assert occ.fragmentation == pytest.approx(1 - 7 / 11)
    alloc.free(ext[4])
    assert alloc.free_extents() == [(0, 16 * A)]
    alloc.audit_invariants()


def test_exhaustion_leaves_state_unchanged_and_names_sizes():
    alloc = ExtentAllocator(8 * A, A)
    keep = [alloc.allocate(A) for _ in range(8)]
    for e in keep[::2]:
        alloc.free(e)  # 4 units free, largest 1 unit
    before = alloc.snapshot()
    with pytest.raises(ExtentAllocationError) as info:
        alloc.allocate(2 * A, "main")
    err = info.value
    assert (err.requested_bytes, err.span_bytes, err.largest_free_extent, err.free_bytes) == (2 * A, 2 * A, A, 4 * A)
    msg = str(err)
    assert "512 bytes" in msg and "largest free extent is 256 bytes" in msg and "free bytes 1024" in msg
    assert "fragmentation" in msg
    assert alloc.snapshot() == before
    with pytest.raises(ExtentAllocationError, match="not enough free bytes"):
        alloc.allocate(5 * A)
    with pytest.raises(ExtentAllocationError, match="arena capacity is 2048 bytes"):
        alloc.allocate(9 * A)
    assert alloc.snapshot() == before


def test_stale_handles_are_rejected():
    alloc = ExtentAllocator(8 * A, A)
    e = alloc.allocate(100)
    alloc.free(e)
    before = alloc.snapshot()
    with pytest.raises(StaleExtentError, match="stale"):
        alloc.free(e)  # double free
    again = alloc.allocate(100)  # reuses the slot at a new generation
    assert again.slot == e.slot and again.generation == e.generation + 1 and again.offset == e.offset
    with pytest.raises(StaleExtentError, match="generation 0"):
        alloc.check(e)
    assert not alloc.is_live(e) and alloc.is_live(again)
    other = ExtentAllocator(8 * A, A)
    with pytest.raises(StaleExtentError, match="another arena"):
        other.free(again)
    with pytest.raises(TypeError, match="HostExtent"):
        alloc.free("extent")
    assert alloc.snapshot() != before  # `again` was allocated; nothing else changed
    alloc.audit_invariants()


def test_argument_errors():
    with pytest.raises(ValueError, match="power of two"):
        ExtentAllocator(1000, 3)
    with pytest.raises(ValueError, match="multiple of alignment=256"):
        ExtentAllocator(1000, 256)
    alloc = ExtentAllocator(4 * A, A)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"integer in \[1, 1024\]"):
            alloc.allocate(bad)
    with pytest.raises(ValueError, match="non-empty string"):
        alloc.allocate(10, "")


def test_plan_rejected_by_fragmentation_although_free_bytes_suffice():
    alloc = ExtentAllocator(8 * A, A)
    units = [alloc.allocate(A, "main") for _ in range(8)]
    for e in units[1::2]:
        alloc.free(e)  # free: 4 holes of one unit, 4 * A bytes
    before = alloc.snapshot()
    assert alloc.free_bytes == 4 * A
    recipe = [("allocate", A, "main"), ("allocate", 2 * A, "mtp")]
    with pytest.raises(InvalidPlanError) as info:
        alloc.validate_plan(recipe)
    err = info.value
    assert err.step == 1 and err.requested_bytes == 2 * A
    assert err.largest_free_extent == A and err.free_bytes == 3 * A  # after step 0 took one hole
    assert "recipe step 1" in str(err)
    with pytest.raises(InvalidPlanError):
        alloc.execute_plan(recipe)
    assert alloc.snapshot() == before


def test_release_earlier_in_recipe_makes_later_allocation_fit():
    alloc = ExtentAllocator(8 * A, A)
    units = [alloc.allocate(A) for _ in range(8)]
    for e in units[1::2]:
        alloc.free(e)
    # releasing unit 2 merges holes 1, 2, 3 into a 3-unit extent at offset A
    recipe = [("allocate", 3 * A, "main")]
    with pytest.raises(InvalidPlanError):
        alloc.validate_plan(recipe)
    recipe = [("release", units[2])] + recipe
    before = alloc.snapshot()
    plan = alloc.validate_plan(recipe)
    assert plan.offsets == (A,) and plan.spans == (3 * A,)
    assert plan.released_bytes == A and plan.allocated_bytes == 3 * A
    assert plan.free_bytes_after == 2 * A and plan.largest_free_after == A
    assert plan.version == alloc.version
    assert alloc.snapshot() == before  # validation changes nothing
    (new,) = alloc.execute_plan(recipe)
    assert new.offset == A and new.nbytes == 3 * A
    assert not alloc.is_live(units[2])
    alloc.audit_invariants()


def test_plan_errors_leave_state_unchanged():
    alloc = ExtentAllocator(8 * A, A)
    e = alloc.allocate(A)
    stale = alloc.allocate(A)
    alloc.free(stale)
    before = alloc.snapshot()
    with pytest.raises(StaleExtentError, match="released twice"):
        alloc.validate_plan([("release", e), ("release", e)])
    with pytest.raises(StaleExtentError, match="recipe step 0"):
        alloc.execute_plan([("release", stale), ("allocate", A)])
    with pytest.raises(ValueError, match="recipe step 1"):
        alloc.validate_plan([("allocate", A), ("grow", A)])
    with pytest.raises(ValueError, match="recipe step 0: nbytes"):
        alloc.validate_plan([("allocate", 0)])
    with pytest.raises(TypeError, match="sequence of steps"):
        alloc.validate_plan(5)
    assert alloc.snapshot() == before


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 5 * A), st.sampled_from(["main", "mtp"])),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("plan"), st.integers(0, 1000), st.integers(1, 6 * A)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_random_sequences_keep_invariants(ops):
    capacity = 32 * A
    alloc = ExtentAllocator(capacity, A)
    live = []
    for op in ops:
        if op[0] == "alloc":
            _, nbytes, tag = op
            span = alloc.span_of(nbytes)
            before = alloc.snapshot()
            largest = max((s for _, s in alloc.free_extents()), default=0)
            if span > largest:
                with pytest.raises(ExtentAllocationError):
                    alloc.allocate(nbytes, tag)
                assert alloc.snapshot() == before
            else:
                e = alloc.allocate(nbytes, tag)
                assert e.offset % A == 0 and e.span == span and e.nbytes == nbytes
                live.append(e)
        elif op[0] == "free" and live:
            alloc.free(live.pop(op[1] % len(live)))
        elif op[0] == "plan":
            recipe = ([("release", live[op[1] % len(live)])] if live else []) + [("allocate", op[2], "main")]
            before = alloc.snapshot()
            try:
                plan = alloc.validate_plan(recipe)
            except InvalidPlanError:
                assert alloc.snapshot() == before
                continue
            assert alloc.snapshot() == before
            new = alloc.execute_plan(recipe)
            assert tuple(e.offset for e in new) == plan.offsets
            assert alloc.free_bytes == plan.free_bytes_after
            assert alloc.largest_free_extent == plan.largest_free_after
            if len(recipe) == 2:
                live.remove(recipe[0][1])
            live.extend(new)
        alloc.audit_invariants()  # no overlap, coverage, coalescing, accounting
        # live extents never overlap
        spans = sorted((e.offset, e.end) for e in live)
        assert all(a_end <= b_off for (_, a_end), (b_off, _) in zip(spans, spans[1:]))
        occ = alloc.occupancy()
        assert occ.used_bytes == sum(e.nbytes for e in live)
        assert occ.padding_bytes == sum(e.padding for e in live)
        assert occ.used_bytes + occ.padding_bytes + occ.free_bytes == capacity
        free = alloc.free_extents()
        assert all(o1 + s1 < o2 for (o1, s1), (o2, _) in zip(free, free[1:]))  # no two adjacent free extents
        assert sorted(alloc.live_extents(), key=lambda e: e.offset) == sorted(live, key=lambda e: e.offset)
    for e in live:
        alloc.free(e)
    assert alloc.free_extents() == [(0, capacity)]
    occ = alloc.occupancy()
    assert (occ.used_bytes, occ.padding_bytes, occ.extent_count, occ.tags) == (0, 0, 0, {})
