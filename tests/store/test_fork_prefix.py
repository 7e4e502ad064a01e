"""Activation from a prefix of a checkpoint (``activate(..., source=ck, source_tokens=n)``).

Every pool set (ordinary; Main + MTP; Main + Draft Full), over a checkpoint whose pools stand at
different frontiers — Main at ``F = 200``, MTP one behind (as a retained MTP prefix job leaves it),
Draft Full at 150 — and whose pages lie in a random physical order:

* each pool continues from ``n`` (MTP: ``n - 1``), capped at its own frontier; ``n = F`` is the
  whole checkpoint, exactly like ``source_tokens=None``;
* the full pages below the continuation are shared (references, physical pages), the partial tail
  is a private COW copy of the first ``n mod P`` columns, the device bytes equal the checkpoint's;
  appends go to private pages and leave every byte of the checkpoint as it was;
* a Host-only checkpoint gets back on the device only the pages the continuation reads;
* ``release_source=True`` forks the prefix and releases the checkpoint (a pool continuing from its
  whole frontier moves), refused while an in-flight copy pins the checkpoint;
* bad values are refused with nothing changed; a fault at any stage undoes everything;
* ``resync`` dates the fork at its continuation: a state that missed the fork reports exactly it.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_kv.schema.mesh_spec import MeshSpec
from ninfer_kv.planning import plan_kv_cache_mesh
from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.store import ACTIVATION_STAGES, KVStore
from ninfer_kv.schema.errors import LifecycleError, StaleHandleError
from ninfer_kv.store.activation import PREFIX_LOOKAHEAD
from ninfer_kv.store.sharded import ShardedKVStore

from .helpers import CONFIGS, P, assert_same, content_ok, page_bytes, planes_of, sync, tiny_plan, write_tokens
from .test_resync_sources import Pair, _write
from ninfer_kv.device import allocate_state, offload_checkpoint

MAIN, MTP, DRAFT = PoolKind.MAIN, PoolKind.MTP, PoolKind.DRAFT_FULL
FRONTIERS = {MAIN: 200, MTP: 199, DRAFT: 150}  # the checkpoint's committed frontier per pool
F = FRONTIERS[MAIN]
CUTS = (1, 63, 64, 65, 128, 150, 170, 199, F)  # page boundaries, mid-page, around the other pools' frontiers


class InjectedFault(RuntimeError):
    pass


def values(kind, start: int, n: int, base: int = 0) -> list[float]:
    """Token values exact in bf16, distinct per pool and position (``base`` shifts them)."""
    k = list(PoolKind).index(kind)
    return [float(1 + (base + 37 * k + t) % 250) for t in range(start, start + n)]


def continued(kind, n: int | None) -> int:
    """The tokens pool ``kind`` continues from after a fork at ``n`` (``None``: the whole checkpoint)."""
    whole = FRONTIERS[kind]
    if n is None or n == F:
        return whole
    return min(whole, max(0, n - PREFIX_LOOKAHEAD.get(kind, 0)))


def checkpoint_store(backend: str, seed: int = 0, host: bool = False):
    """A store holding one checkpoint at :data:`FRONTIERS`, its pages in a random physical order.

    One-page filler sequences hold the lowest pages; the writer maps one page at a time, a random
    filler released before most of them, so each of its blocks lands on whichever page was freed.
    Returns ``(store, checkpoint, {pool: committed token values})``."""
    rng = np.random.default_rng(seed)
    store = KVStore(tiny_plan(backend, max_context=256, max_concurrency=6, pages=8),
                    host_bytes=(1 << 20) if host else None)
    kinds = store.pool_kinds
    fillers = []
    for _ in range(4):
        f = store.activate(P, 0)
        for kind in kinds:
            store.map(f, P, pool=kind)
        fillers.append(f)
    w = store.activate(256, 0)
    for b in range(4):
        if fillers and rng.random() < 0.8:
            store.finish(fillers.pop(int(rng.integers(len(fillers)))))
        for kind in kinds:
            if b * P < FRONTIERS[kind]:
                store.map(w, min((b + 1) * P, FRONTIERS[kind]), pool=kind)
    for f in fillers:
        store.finish(f)
    content = {}
    for kind in kinds:
        content[kind] = values(kind, 0, FRONTIERS[kind])
        write_tokens(store, kind, store.row(w), 0, content[kind])
        store.commit(w, FRONTIERS[kind], pool=kind)
    ck = store.finish(w, retain=True)
    sync(store)
    return store, ck, content


def _bytes(store, kind, phys) -> list:
    planes = {n: np.asarray(x) for n, x in planes_of(store, kind).items()}
    axis = store.layout(kind).order.page_axis
    return [page_bytes(planes, axis, int(p)) for p in phys]


@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_fork_at_every_prefix_shares_full_pages_and_copies_the_tail(backend):
    store, ck, content = checkpoint_store(backend, seed=1)
    kinds = store.pool_kinds
    ck_phys = {k: store.address_space(ck, k).physical_pages.copy() for k in kinds}
    assert any((np.diff(p) < 0).any() for p in ck_phys.values())  # a random physical order
    ck_bytes = {k: _bytes(store, k, ck_phys[k]) for k in kinds}
    for n in CUTS:
        allocated = {k: store.pool(k).allocated for k in kinds}
        h = store.activate(n + 3, 253 - n, source=ck, source_tokens=n)
        store.audit_invariants()
        for k in kinds:
            c = continued(k, n)
            full, partial = divmod(c, P)
            space = store.address_space(h, k)
            assert space.committed_frontier == c and space.protected_frontier == full * P, (k, n)
            assert space.num_blocks == full + (partial > 0)
            assert np.array_equal(space.physical_pages[:full], ck_phys[k][:full])  # shared, immutable
            if partial:
                assert space.physical_pages[full] not in ck_phys[k]  # the private COW tail
            assert [p.references for p in space.pages()] == [2] * full + [1] * (partial > 0)
            refs = [p.references for p in store.address_space(ck, k).pages()]
            assert refs == [2] * full + [1] * (len(refs) - full)
            assert store.pool(k).allocated == allocated[k] + (partial > 0)
            assert content_ok(store, k, h, content[k][:c])  # the device bytes below the continuation
        # appends after the continuation go to private pages; the checkpoint keeps every byte
        for k in kinds:
            c = continued(k, n)
            m = min(70, 256 - c)
            store.map(h, c + m, pool=k)
            new = values(k, c, m, base=101)
            write_tokens(store, k, store.row(h), c, new)
            store.commit(h, c + m, pool=k)
            assert content_ok(store, k, h, content[k][:c] + new)
            assert content_ok(store, k, ck, content[k])
            assert _bytes(store, k, ck_phys[k]) == ck_bytes[k], (k, n)
        store.audit_invariants()
        store.finish(h)
    store.release_checkpoint(ck)
    store.audit_invariants()
    assert all(store.pool(k).allocated == 0 and store.pool(k).reserved == 0 for k in kinds)


@pytest.mark.parametrize("release", [False, True])
@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_the_whole_frontier_is_the_default(backend, release):
    """``source_tokens=F`` is exactly ``source_tokens=None`` (Fork, or Move with ``release_source``)."""
    (a, ck_a, _), (b, ck_b, _) = checkpoint_store(backend, seed=2), checkpoint_store(backend, seed=2)
    a.activate(F + 10, 30, source=ck_a, release_source=release)
    b.activate(F + 10, 30, source=ck_b, source_tokens=F, release_source=release)
    assert_same(a.snapshot(), b.snapshot())


@pytest.mark.parametrize("n", [64, 100, 170])
@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_release_source_at_a_prefix_forks_then_releases(backend, n):
    store, ck, content = checkpoint_store(backend, seed=3)
    kinds = store.pool_kinds
    ck_phys = {k: store.address_space(ck, k).physical_pages.copy() for k in kinds}
    h = store.activate(n, 0, source=ck, source_tokens=n, release_source=True)
    with pytest.raises(StaleHandleError):
        store.checkpoint(ck)
    store.audit_invariants()
    for k in kinds:
        c, whole = continued(k, n), FRONTIERS[k]
        space = store.address_space(h, k)
        assert space.committed_frontier == c
        if c == whole:  # nothing of this pool is cut: its pages move (the tail continues in place)
            assert np.array_equal(space.physical_pages, ck_phys[k])
            assert space.protected_frontier == 0
        else:  # a Fork whose source is gone: only its shared full pages and the COW tail remain
            full = c // P
            assert np.array_equal(space.physical_pages[:full], ck_phys[k][:full])
            assert space.protected_frontier == full * P
        assert store.pool(k).allocated == space.num_blocks  # the pages beyond the prefix are released
        assert content_ok(store, k, h, content[k][:c])
    store.finish(h)
    store.audit_invariants()
    assert all(store.pool(k).allocated == 0 for k in kinds)


def test_release_source_waits_for_an_in_flight_copy():
    """A prefix activation that releases its source is refused while an offload pins the source's
    pages (as ``release_checkpoint`` is); the same Fork without the release goes ahead."""
    store, ck, content = checkpoint_store("mtp", seed=7, host=True)
    plan = store.plan_offload(ck)
    before = store.snapshot()
    with pytest.raises(LifecycleError, match="pinned by an in-flight copy; it cannot be released now"):
        store.activate(100, 0, source=ck, source_tokens=100, release_source=True)
    assert_same(before, store.snapshot())
    h = store.activate(100, 0, source=ck, source_tokens=100)
    store.audit_invariants()
    store.cancel_offload(plan)
    h2 = store.activate(100, 0, source=ck, source_tokens=100, release_source=True)
    assert ck not in store.checkpoints()
    for x in (h, h2):
        assert all(content_ok(store, k, x, content[k][: continued(k, 100)]) for k in store.pool_kinds)
    store.audit_invariants()


@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_a_host_only_source_restores_only_the_pages_the_prefix_reads(backend):
    store, ck, content = checkpoint_store(backend, seed=4, host=True)
    kinds = store.pool_kinds
    offload_checkpoint(store, ck, sync(store))
    store.drop_device_replica(ck)
    assert all(store.pool(k).allocated == 0 for k in kinds)
    for n in (64, 100, F):  # each fork reads more of the checkpoint
        on_device = {k: [p.device_lease is not None for p in store.address_space(ck, k).pages()] for k in kinds}
        allocated = {k: store.pool(k).allocated for k in kinds}
        h = store.activate(n, 10, source=ck, source_tokens=n)
        store.audit_invariants()
        for k in kinds:
            c = continued(k, n)
            read = -(-c // P)
            pages = store.address_space(ck, k).pages()
            assert [p.device_lease is not None for p in pages] == [True] * read + on_device[k][read:], (k, n)
            assert all(p.host_replica is not None for p in pages)
            restored = read - sum(on_device[k][:read])
            assert store.pool(k).allocated == allocated[k] + restored + (c % P > 0)
            assert content_ok(store, k, h, content[k][:c])
            assert content_ok(store, k, ck, content[k])  # Host-only pages read from the arena
        store.finish(h)
    store.release_checkpoint(ck)
    store.audit_invariants()


@pytest.mark.parametrize("backend", ["ordinary", "mtp"])
def test_bad_source_tokens_change_nothing(backend):
    store, ck, _ = checkpoint_store(backend, seed=5)
    empty = store.finish(store.activate(0, 0), retain=True)  # a checkpoint holding no token
    cases = [
        (dict(source=ck, source_tokens=True), TypeError, "source_tokens must be an integer, got bool"),
        (dict(source=ck, source_tokens=64.0), TypeError, "source_tokens must be an integer"),
        (dict(source=ck, source_tokens="64"), TypeError, "source_tokens must be an integer"),
        (dict(source=ck, source_tokens=0), ValueError, "that is the root, pass source=None"),
        (dict(source=ck, source_tokens=-1), ValueError, f"source_tokens=-1 is outside .* allowed 1..{F}"),
        (dict(source=ck, source_tokens=F + 1), ValueError, f"source_tokens={F + 1} is outside .* allowed 1..{F}"),
        (dict(source=ck, source_tokens=121), ValueError, "source_tokens=121 exceeds prompt_tokens=120"),
        (dict(source=None, source_tokens=5), ValueError, "source_tokens=5 needs a source checkpoint"),
        (dict(source=empty, source_tokens=1), ValueError, "holds no Main tokens"),
    ]
    for kwargs, exc, match in cases:
        before = store.snapshot()
        with pytest.raises(exc, match=match):
            store.activate(120, 10, release_source=kwargs["source"] is not None, **kwargs)
        assert_same(before, store.snapshot(), f"after {kwargs}")
    h = store.activate(120, 10, source=ck, source_tokens=np.int64(120))  # any integer type
    assert store.address_space(h).committed_frontier == 120
    store.audit_invariants()


def _points(store, host: bool):
    pts = []
    for stage in ACTIVATION_STAGES:
        if stage in ("lease_rows", "publish_active"):
            pts.append((stage, None))
            continue
        for kind in store.pool_kinds:
            pts.append((stage, kind))
            if host and stage == "restore_host":  # the restore's own stages, inside restore_host
                pts += [("restore_copy", kind), ("restore_verify", kind)]
    return pts


@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_a_fault_at_any_stage_undoes_a_prefix_activation(backend):
    """A Host-only source, a prefix at a page boundary (kept) and one mid-page (released)."""
    store, ck, content = checkpoint_store(backend, seed=6, host=True)
    offload_checkpoint(store, ck, sync(store))
    store.drop_device_replica(ck)
    for n, release in ((128, False), (170, True)):  # each reads Host-only pages
        for stage, pool in _points(store, host=True):
            before = store.snapshot()
            seen = []

            def fault(s, p, stage=stage, pool=pool):
                seen.append((s, p))
                if (s, p) == (stage, pool):
                    raise InjectedFault(f"{s}/{p}")

            store.fault_injector = fault
            with pytest.raises(InjectedFault):
                store.activate(n + 5, 20, source=ck, source_tokens=n, release_source=release)
            store.fault_injector = None
            assert (stage, pool) in seen
            assert_same(before, store.snapshot(), f"after a fault at {stage}/{pool}")
        store.audit_invariants()
        h = store.activate(n + 5, 20, source=ck, source_tokens=n, release_source=release)
        store.audit_invariants()
        for k in store.pool_kinds:
            assert content_ok(store, k, h, content[k][: continued(k, n)])
        assert (ck in store.checkpoints()) == (not release)
        store.finish(h)


def test_sharded_store_forwards_source_tokens():
    plan = plan_kv_cache_mesh(ModelKVConfig(1, 2, 8, "bf16"), MeshSpec.parse("data=2,model=1"), max_context=256,
                              max_concurrency=4, policy=ExplicitCapacity(2 * 8 * P))
    store = ShardedKVStore(plan)
    h = store.activate(150, 0, shard=1)
    store.map(h, 150)
    store.commit(h, 150)
    ck = store.finish(h, retain=True)
    before = store.snapshot()
    with pytest.raises(ValueError, match="allowed 1..150"):
        store.activate(200, 0, shard=1, source=ck, source_tokens=151)
    assert_same(before, store.snapshot())
    f = store.activate(100, 0, shard=1, source=ck, source_tokens=70, release_source=True)
    assert store.store(1).address_space(f.handle).committed_frontier == 70 and ck not in store.checkpoints()
    store.audit_invariants()


# -- resync dates a prefix fork at its continuation ----------------------------------------------------------


class PrefixPair(Pair):
    """:class:`Pair` with a committed frontier per pool, forks from a prefix, and fork appends whose
    values differ from the source's at the same positions (so a repair that took the checkpoint's
    content past the continuation for the fork's would show)."""

    def __init__(self, backend: str, kind: str = "lagging"):
        super().__init__(backend, kind)
        self.own: dict = {}  # fork -> {pool: its continuation}; its own tokens start there

    def values(self, h, kind, start: int, n: int) -> np.ndarray:
        k = list(self.store.pool_kinds).index(kind)
        own = self.own.get(h, {}).get(kind, 1 << 30)
        return np.asarray([1 + (self.base[h] + 31 * k + t + (97 if t >= own else 0)) % 250
                           for t in range(start, start + n)], np.float32)

    def activate(self, prompt, budget, base, source=None, source_tokens=None):
        h = self.store.activate(prompt, budget, source=source, source_tokens=source_tokens)
        kinds = self.store.pool_kinds
        self.tokens[h] = {k: self.store.address_space(h, k).committed_frontier for k in kinds}
        self.base[h] = self.base[source] if source is not None else base
        if source is not None:
            self.own[h] = dict(self.tokens[h])
        return h

    def append(self, h, n: int) -> None:
        for kind in self.store.pool_kinds:
            self.store.map(h, self.tokens[h][kind] + n, pool=kind)
        self._appends.append((h, n))

    def step(self) -> None:
        self.take()
        store = self.store
        for h, n in self._appends:
            row = store.row(h)
            for kind in store.pool_kinds:
                start = self.tokens[h][kind]
                vals = self.values(h, kind, start, n)
                self.ref = _write(self.ref, store, kind, row, start, vals)
                if self.follow:
                    self.dut = _write(self.dut, store, kind, row, start, vals)
                store.commit(h, start + n, pool=kind)
                self.tokens[h][kind] = start + n
        self._appends = []

    def check_content(self) -> None:
        store, lost = self.store, self.store.lost()
        for kind in store.pool_kinds:
            dut = {n: np.asarray(x) for n, x in self.dut.pool_planes(kind).items()}
            ref = {n: np.asarray(x) for n, x in self.ref.pool_planes(kind).items()}
            for h, tokens in self.tokens.items():
                n = lost[h][kind] if h in lost else tokens[kind]
                expected = list(self.values(h, kind, 0, n))
                assert content_ok(store, kind, h, expected, ref), (h, kind, "reference")
                assert content_ok(store, kind, h, expected, dut), (h, kind, n)


@pytest.mark.parametrize("kind, placement", [("lagging", "device"), ("blank", "device"), ("blank", "host")])
@pytest.mark.parametrize("n", [64, 100])
@pytest.mark.parametrize("backend", ["mtp", "dflash"])
def test_resync_dates_a_prefix_fork_at_its_continuation(backend, n, kind, placement, monkeypatch):
    """A checkpoint of 150 tokens, then the slip, a work, and a fork at ``n`` that appends 20 tokens the
    state never sees: the fork is intact exactly up to its continuation (what its pages got from the
    checkpoint: shared pages, a replayed COW of ``n mod P`` columns), the checkpoint is intact unless
    no source holds it."""
    s = PrefixPair(backend, kind)
    base = s.activate(150, 0, base=10)
    s.append(base, 150)
    s.step()
    ck = s.finish(base)
    s.place(ck, placement)
    if kind == "lagging":
        s.follow = False
    s.take()  # a work between the slip and the fork: the fork's dating at the state's epoch is the carry's
    fork = s.activate(n + 20, 40, base=0, source=ck, source_tokens=n)
    cont = dict(s.tokens[fork])
    assert cont[PoolKind.MAIN] == n and all(c == n - PREFIX_LOOKAHEAD.get(k, 0) for k, c in cont.items())
    s.append(fork, 20)
    s.step()
    if kind == "blank":
        s.dut = allocate_state(s.store, fill=float("nan"))
    s.repair(monkeypatch)
    pools = s.store.pool_kinds
    gone = kind == "blank" and placement == "device"  # the checkpoint exists nowhere else
    expect = {fork: {k: 0 for k in pools} if gone else cont}
    if gone:
        expect[ck] = dict.fromkeys(pools, 0)
    assert s.lost() == expect
    s.check_content()
    if not gone:  # truncated back to its continuation, the fork serves again
        for k in pools:
            s.store.truncate(fork, cont[k], pool=k)
            s.tokens[fork][k] = cont[k]
        s.append(fork, 30)
        s.step()
        s.check_content()
