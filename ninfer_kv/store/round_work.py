"""Round work: what the device must do before the next unit reads, and the pure function doing it.

The store records device work on the host as it plans it and hands it out with
:meth:`KVStore.take_work` as one :class:`RoundWork`: a pytree of numpy arrays in bucketed, fixed
shapes.  :func:`apply_work` applies it to a :class:`~ninfer_kv.store.device_state.KVDeviceState`;
it is a pure function of arrays, so the caller runs it inside its own jitted step (a decode round
is then one dispatch) or jitted alone (:func:`apply_work_jit`).

Per pool a work holds

* ``tables``: ``int32 (3, U)`` block-table updates ``(row, block, page)``; padding rows are ``C``
  (dropped by the scatter);
* ``copies``: ``int32 (3, K)`` page writes from device pages ``(src, dst, columns)``: columns
  ``[0, columns)`` of ``src`` onto ``dst`` (partial-tail COW);
* ``restores``: ``int32 (2, R)`` page writes from the Host payload ``(dst, columns)`` and
  ``payload``: per plane ``(R, layers, H, P, X)`` unsigned words of the plane's width (the Host
  replica's bytes, so any payload — NaN bit patterns included — lands byte-exactly).

Padding entries have ``columns == 0`` and destination ``N`` (out of range: dropped).  Every
destination is distinct within a work and every source reads the content the page had *before*
the work: :class:`PageWrites` resolves a write whose source was itself written earlier in the same
work to that earlier write's source, and a later write to a destination replaces an earlier one
(the earlier content of a freed-and-reused page is dead), so one parallel gather-then-scatter
equals the sequential history.  Bucketed shapes (``U``, ``K``, ``R`` from fixed ladders, ``0``
included, where the work is skipped at trace time) bound the compilations of any step that
applies a work: one per bucket combination.

Order: ``work.serial`` is the number of works the store handed out before this one; the state's
``serial`` must equal it.  :func:`apply_work` advances a matching serial and poisons a mismatched
one (``POISONED``, sticky, the first mismatch recorded in ``state.fault``).  A poisoned state
applies nothing more and its block tables hold only the sentinel page, so every append over them
is dropped and every attention sees no key: a skipped, repeated or reordered work can cost the
tokens of the steps that follow, never another sequence's pages.  :meth:`KVStore.check_state`
(one host read) detects it however many steps later, and :func:`resync` repairs the state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..geometry import PAGE_SIZE
from ..page_copy import _words, cpu_float, word_dtype, write_pages, write_pages_donated
from .block_tables import SENTINEL_PAGE
from .buckets import bucket, ladder
from .step_shapes import StepWorkShapes, step_work_shape, step_work_shapes
from .device_state import POISONED, KVDeviceState, check_live

__all__ = [
    "RoundWork",
    "PoolWork",
    "PendingWork",
    "PageWrites",
    "apply_work",
    "apply_work_jit",
    "gather_pages",
    "GatherRequest",
    "OffloadPayload",
    "step_work_shape",
    "step_work_shapes",
    "StepWorkShapes",
    "take_step_work",
    "resync",
    "bucket",
    "ladder",
    "word_dtype",
]

# -- the work pytree --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PoolWork:
    """One pool's part of a :class:`RoundWork` (see the module docstring for the arrays).

    ``pad_row`` (``C``) and ``pad_page`` (``N``) are the out-of-range padding targets.  As a pytree
    its leaves are the non-empty arrays only (an empty bucket is part of the static structure), so
    a decode round's work is its table updates and nothing else to transfer.
    """

    tables: np.ndarray
    copies: np.ndarray
    restores: np.ndarray
    payload: dict
    pad_row: int = 0
    pad_page: int = 0

    @property
    def empty(self) -> bool:
        return not (self.tables.shape[1] or self.copies.shape[1] or self.restores.shape[1])

    def used(self) -> tuple[int, int, int]:
        """Entries that carry work (not padding): table updates, copies, restores."""
        return (
            int((self.tables[0] != self.pad_row).sum()),
            int((self.copies[2] > 0).sum()),
            int((self.restores[1] > 0).sum()),
        )

    def without_page_writes(self) -> "PoolWork":
        payload = {n: np.zeros((0,) + x.shape[1:], x.dtype) for n, x in self.payload.items()}
        return PoolWork(self.tables, np.zeros((3, 0), np.int32), np.zeros((2, 0), np.int32), payload,
                        self.pad_row, self.pad_page)

    def pad_to(self, tables: int, copies: int, restores: int) -> "PoolWork":
        """The same work in larger buffers (padding entries do nothing)."""
        t, k, r = self.tables.shape[1], self.copies.shape[1], self.restores.shape[1]
        if t > tables or k > copies or r > restores:
            raise ValueError(f"a work of sizes ({t}, {k}, {r}) does not fit ({tables}, {copies}, {restores})")
        out_t = self.tables
        if tables > t:
            out_t = np.zeros((3, tables), np.int32)
            out_t[:, :t] = self.tables
            out_t[0, t:] = self.pad_row
        out_k = self.copies
        if copies > k:
            out_k = np.zeros((3, copies), np.int32)
            out_k[:, :k] = self.copies
            out_k[1, k:] = self.pad_page
        out_r, payload = self.restores, self.payload
        if restores > r:
            out_r = np.zeros((2, restores), np.int32)
            out_r[:, :r] = self.restores
            out_r[0, r:] = self.pad_page
            payload = {}
            for name, x in self.payload.items():
                y = np.zeros((restores,) + x.shape[1:], x.dtype)
                y[:r] = x
                payload[name] = y
        return PoolWork(out_t, out_k, out_r, payload, self.pad_row, self.pad_page)


def _empty(x) -> bool:
    """An empty numpy buffer: static structure, not a leaf (any other leaf object is kept)."""
    return isinstance(x, np.ndarray) and x.size == 0


def _pool_work_flatten(pw: PoolWork):
    arrays = [("tables", pw.tables), ("copies", pw.copies), ("restores", pw.restores)]
    arrays += [(f"payload/{n}", x) for n, x in sorted(pw.payload.items())]
    kids = [x for _, x in arrays if not _empty(x)]
    spec = tuple((name, (tuple(x.shape), x.dtype.str) if _empty(x) else None) for name, x in arrays)
    return kids, (pw.pad_row, pw.pad_page, spec)


def _pool_work_unflatten(aux, kids) -> PoolWork:
    pad_row, pad_page, spec = aux
    it = iter(kids)
    vals = {name: next(it) if empty is None else np.zeros(empty[0], np.dtype(empty[1])) for name, empty in spec}
    payload = {name[len("payload/"):]: v for name, v in vals.items() if name.startswith("payload/")}
    return PoolWork(vals["tables"], vals["copies"], vals["restores"], payload, pad_row, pad_page)


jax.tree_util.register_pytree_node(PoolWork, _pool_work_flatten, _pool_work_unflatten)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["serial", "pools", "store"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RoundWork:
    """Everything the device must do before the next unit reads (one :meth:`KVStore.take_work`).

    Attributes:
      serial: ``int32 ()`` works the store handed out before this one.
      pools: ``{PoolKind: PoolWork}``.
      store: ``int32 ()`` the identity of the store that took it (``KVStore.identity``; 0 for a work
        built by hand, which any state accepts); a state bound to another store is poisoned by it.
    """

    serial: np.ndarray
    pools: dict
    store: np.ndarray = dataclasses.field(default_factory=lambda: np.asarray(0, np.int32))

    @property
    def empty(self) -> bool:
        """Nothing for the device to do (the serial must still be applied: works are never skipped)."""
        return all(p.empty for p in self.pools.values())

    def counts(self) -> dict:
        """``{PoolKind: (table updates, copies, restores)}`` in bucketed (padded) sizes."""
        return {k: (p.tables.shape[1], p.copies.shape[1], p.restores.shape[1]) for k, p in self.pools.items()}

    def fits(self, tables: int, copies: int = 0, restores: int = 0) -> bool:
        """Whether every pool's part fits buffers of these sizes (see :meth:`pad_to`)."""
        return all(t <= tables and k <= copies and r <= restores for t, k, r in self.counts().values())

    def without_page_writes(self) -> "RoundWork":
        """The table updates and the serial of this work, its page writes removed."""
        return RoundWork(self.serial, {k: p.without_page_writes() for k, p in self.pools.items()}, self.store)

    def pad_to(self, tables: int, copies: int = 0, restores: int = 0) -> "RoundWork":
        """The same work with every pool's buffers padded to fixed sizes, so a step that applies
        works has one signature: a caller takes the work, applies an oversized one alone
        (:func:`apply_work_jit`) and passes the next (empty) take padded into its step."""
        return RoundWork(self.serial, {k: p.pad_to(tables, copies, restores) for k, p in self.pools.items()}, self.store)


class PendingWork(NamedTuple):
    """What one pool's part of the next take holds: distinct block-table entries, COW copies and
    Host restores that carry work (:meth:`KVStore.pending_work`; the take pads each to its bucket)."""

    tables: int
    copies: int
    restores: int

    @property
    def empty(self) -> bool:
        """Nothing is pending."""
        return not (self.tables or self.copies or self.restores)


# -- host side: pending page writes -------------------------------------------------------------------


class PageWrites:
    """Pending page writes of one pool between two takes, resolved to pre-work sources.

    ``writes[dst] = (from_payload, source, columns)``: ``source`` is a device page (content before
    the work) or an index into ``payload``.  A journal makes every change undoable
    (:meth:`mark` / :meth:`rollback`), for activation and transfer rollbacks.
    """

    def __init__(self, layout, num_pages: int):
        self.layout = layout
        self.num_pages = int(num_pages)
        self.names = tuple(layout.plane_names)
        self.writes: dict[int, tuple[bool, int, int]] = {}
        self.payload: list[dict] = []
        self._journal: list[tuple[int, tuple | None]] = []
        self.copy_buckets = ladder(8, 8, self.num_pages)
        self.restore_buckets = ladder(1, 2, self.num_pages)

    def __len__(self) -> int:
        return len(self.writes)

    def counts(self) -> tuple[int, int]:
        """Pending ``(copies, restores)``: distinct destinations written from device pages and from
        Host payloads."""
        restores = sum(1 for from_payload, _, _ in self.writes.values() if from_payload)
        return len(self.writes) - restores, restores

    def mark(self) -> tuple[int, int]:
        return len(self._journal), len(self.payload)

    def rollback(self, mark: tuple[int, int]) -> None:
        n, m = mark
        while len(self._journal) > n:
            dst, prev = self._journal.pop()
            if prev is None:
                del self.writes[dst]
            else:
                self.writes[dst] = prev
        del self.payload[m:]

    def _put(self, dst: int, entry: tuple) -> None:
        self._journal.append((dst, self.writes.get(dst)))
        self.writes[dst] = entry

    def copy(self, src: int, dst: int, columns: int) -> None:
        """Columns ``[0, columns)`` of device page ``src`` onto ``dst`` (as the device would see them
        after every write recorded so far)."""
        src, dst, columns = int(src), int(dst), int(columns)
        if columns <= 0:
            return
        prev = self.writes.get(src)
        if prev is not None:  # src was written in this work: read what that write reads
            self._put(dst, (prev[0], prev[1], min(columns, prev[2])))
        else:
            self._put(dst, (False, src, columns))

    def restore(self, dst_ids: np.ndarray, pages: Mapping[str, np.ndarray]) -> None:
        """Whole pages from a Host payload: ``pages[name][i]`` (``(layers, H, P, X)``) onto
        ``dst_ids[i]``.  The payload is copied (the Host extent may be reused at once)."""
        for i, dst in enumerate(np.asarray(dst_ids).tolist()):
            self.payload.append({name: np.array(pages[name][i], copy=True) for name in self.names})
            self._put(int(dst), (True, len(self.payload) - 1, PAGE_SIZE))

    def touches(self, pages: np.ndarray) -> bool:
        """Whether a pending write targets one of the device ``pages``."""
        return bool(self.writes) and any(int(p) in self.writes for p in np.asarray(pages).tolist())

    def take(self) -> tuple[np.ndarray, np.ndarray, dict]:
        """The pending writes as bucketed ``copies``, ``restores`` and ``payload``; clears them."""
        n_pages = self.num_pages
        dev = [(d, s, c) for d, (p, s, c) in self.writes.items() if not p]
        host = [(d, s, c) for d, (p, s, c) in self.writes.items() if p]
        k = bucket(len(dev), self.copy_buckets)
        copies = np.zeros((3, k), np.int32)
        copies[1] = n_pages
        if dev:
            copies[:, : len(dev)] = np.array(dev, np.int64)[:, [1, 0, 2]].T
        r = bucket(len(host), self.restore_buckets)
        restores = np.zeros((2, r), np.int32)
        restores[0] = n_pages
        payload = {}
        lay = self.layout
        for spec in lay.planes:
            payload[spec.name] = np.zeros(
                (r, lay.num_layers, lay.num_kv_heads, lay.page_size, spec.extent), word_dtype(spec.dtype)
            )
        if host:
            arr = np.array(host, np.int64)
            restores[0, : len(host)] = arr[:, 0]
            restores[1, : len(host)] = arr[:, 2]
            for j, (_, s, _) in enumerate(host):
                row = self.payload[s]
                for name, out in payload.items():
                    out[j] = row[name].view(out.dtype)
        self.writes = {}
        self.payload = []
        self._journal = []
        return copies, restores, payload

    def snapshot(self) -> dict:
        return {"writes": sorted(self.writes.items()), "payload": len(self.payload)}


# -- device side ---------------------------------------------------------------------------------------


def _check_pair(state, work) -> None:
    if not isinstance(state, KVDeviceState):
        raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
    if not isinstance(work, RoundWork):
        raise TypeError(f"work must be a RoundWork, got {type(work).__name__}")
    check_live(state)
    if set(work.pools) != set(state.planes):
        raise ValueError(
            f"the work names pools {sorted(k.value for k in work.pools)}, the state holds "
            f"{sorted(k.value for k in state.planes)}"
        )


def _in_order(serial, owner, work_serial, work_store) -> jax.Array:
    """Whether the work numbered ``work_serial`` of store ``work_store`` is the next work of a healthy
    state at ``serial`` bound to store ``owner`` (0 on either side: unbound)."""
    serial, owner = jnp.asarray(serial, jnp.int32), jnp.asarray(owner, jnp.int32)
    work_store = jnp.asarray(work_store, jnp.int32)
    same_store = (owner == work_store) | (owner == 0) | (work_store == 0)
    return (serial == jnp.asarray(work_serial, jnp.int32)) & (serial >= 0) & same_store


def _gate(entries: jax.Array, row: int, ok: jax.Array) -> jax.Array:
    """``entries`` with row ``row`` (the columns of page writes) zeroed unless ``ok``: padding."""
    return entries.at[row].set(jnp.where(ok, entries[row], 0))


def apply_work(state: KVDeviceState, work: RoundWork) -> KVDeviceState:
    """Apply one :class:`RoundWork` to the state (pure; call it inside a jitted step, donated).

    Table updates are scattered into each pool's ``(C, L)`` matrix; page writes land in the
    planes; ``serial`` advances when ``work.serial`` equals it and the work comes from the state's
    store (an unbound state binds to it).  Otherwise the state is poisoned:
    nothing of the work is applied, every table entry becomes the sentinel page (so the ops of
    this and later steps drop their tokens instead of touching pages), and ``fault`` records the
    first mismatch until :func:`resync` repairs the state.
    """
    _check_pair(state, work)
    ok = _in_order(state.serial, state.owner, work.serial, work.store)
    serial, owner = jnp.asarray(state.serial, jnp.int32), jnp.asarray(state.owner, jnp.int32)
    work_serial, work_store = jnp.asarray(work.serial, jnp.int32), jnp.asarray(work.store, jnp.int32)
    new_serial = jnp.where(ok, serial + 1, jnp.int32(POISONED))
    new_owner = jnp.where(ok & (owner == 0), work_store, owner)
    first = (serial >= 0) & ~ok
    fault = jnp.asarray(state.fault, jnp.int32)
    new_fault = jnp.where(first, jnp.stack([serial, work_serial, work_store]), fault)
    tables, planes = {}, {}
    for kind, pw in work.pools.items():
        table = state.tables[kind]
        if pw.tables.shape[1]:
            upd = jnp.asarray(pw.tables, jnp.int32)
            update = lambda t, upd=upd: t.at[upd[0], upd[1]].set(upd[2], mode="drop")  # noqa: E731
        else:
            update = lambda t: t  # noqa: E731
        # a cond, not a select: the healthy branch updates the donated table in place
        tables[kind] = jax.lax.cond(ok, update, lambda t: jnp.full_like(t, SENTINEL_PAGE), table)
        copies, restores = jnp.asarray(pw.copies, jnp.int32), jnp.asarray(pw.restores, jnp.int32)
        if copies.shape[1]:
            copies = _gate(copies, 2, ok)
        if restores.shape[1]:
            restores = _gate(restores, 1, ok)
        planes[kind] = write_pages(state.planes[kind], copies, restores, pw.payload, state.page_axis(kind))
    return dataclasses.replace(state, planes=planes, tables=tables, serial=new_serial, fault=new_fault, owner=new_owner)


_apply_work_jit = jax.jit(apply_work, donate_argnums=(0,))
_in_order_jit = jax.jit(_in_order)


def apply_work_jit(state: KVDeviceState, work: RoundWork) -> KVDeviceState:
    """:func:`apply_work` run alone, the state donated (when no step applies this work).

    One jitted program; except on the CPU backend with page writes into float planes, where a
    scatter is not kept in place by XLA (the whole plane would be copied): there the page writes run
    as in-place per-page programs (:func:`~ninfer_kv.page_copy.write_pages_donated`, which write
    nothing when the work is out of order), then the table updates and the serial as one program.
    Same result either way.
    """
    _check_pair(state, work)
    writes = [k for k, p in work.pools.items() if p.copies.shape[1] or p.restores.shape[1]]
    if not writes or not any(cpu_float(state.planes[k]) for k in writes):
        return _apply_work_jit(state, work)
    ok = _in_order_jit(state.serial, state.owner, work.serial, work.store)
    planes = dict(state.planes)
    for kind in writes:
        pw = work.pools[kind]
        planes[kind] = write_pages_donated(planes[kind], pw.copies, pw.restores, pw.payload, state.page_axis(kind),
                                           enabled=ok)
    state = dataclasses.replace(state, planes=planes)
    return _apply_work_jit(state, work.without_page_writes())


def _like(x: jax.Array, value) -> jax.Array:
    """``value`` as an int32 array placed like ``x``."""
    return jax.device_put(np.asarray(value, np.int32), x.sharding)


def resync(store, state: KVDeviceState):
    """Bring a poisoned, lagging or blank ``state`` back in line with ``store`` without rebuilding it.

    Reads the state's serial and fault record (one host read), plans the repair on the host
    (:meth:`KVStore.plan_resync`: every block table republished, the page writes the state missed
    replayed from Host replicas still held and live COW sources, the sequences and checkpoints whose
    committed content is gone quarantined) and applies it (the state donated).  Works for a
    :class:`~ninfer_kv.store.KVStore` and a :class:`~ninfer_kv.store.sharded.ShardedKVStore`.

    Returns:
      ``(state, report)``: the repaired state (``store.check_state`` passes) and a
      :class:`~ninfer_kv.store.repair.ResyncReport` naming every quarantined handle with the tokens
      the device still holds of it.  A state already in line is returned as it is.

    Raises:
      WorkOrderError: the state applied more works than the store handed out (another store's).
      DonatedStateError: the state was donated; repair the state the step returned.
    """
    if not isinstance(state, KVDeviceState):
        raise TypeError(f"state must be a KVDeviceState, got {type(state).__name__}")
    check_live(state)
    work, report = store.plan_resync(state.sync_status())
    if work is None:
        return state, report
    state = state.replace(serial=_like(state.serial, work.serial), fault=_like(state.fault, (-1, -1, -1)),
                          owner=_like(state.owner, store.identity))
    if isinstance(work, RoundWork):
        state = apply_work_jit(state, work)
    else:  # a sharded store's stacked work
        state = store.apply_work_alone(state, work)
    return state, report


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pages", "store", "token"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class GatherRequest:
    """What an offload plan asks :func:`gather_pages` for (``OffloadPlan.request``).

    Attributes:
      pages: ``{PoolKind: int32 (B,)}`` Device pages to gather, in logical order (padded).
      store: ``int32 ()`` the identity of the store that made the plan.
      token: ``int32 ()`` the plan's number in that store.
    """

    pages: dict
    store: np.ndarray
    token: np.ndarray


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["store", "token", "serial", "pages", "planes"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class OffloadPayload:
    """The gathered payload of one offload plan, naming what it was gathered for.

    Attributes:
      store, token: the plan's store identity and number (from its :class:`GatherRequest`).
      serial: ``int32 ()`` the applied-work serial of the state it was gathered from.
      pages: ``{PoolKind: int32 (B,)}`` the Device pages gathered.
      planes: ``{PoolKind: {plane: words (B, layers, H, P, X)}}`` their bytes as unsigned words.
    """

    store: jax.Array
    token: jax.Array
    serial: jax.Array
    pages: dict
    planes: dict


def _gather(state: KVDeviceState, pages: Mapping) -> dict:
    out = {}
    for kind, ids in pages.items():
        axis = state.page_axis(kind)
        ids = jnp.asarray(ids, jnp.int32)
        out[kind] = {
            name: jnp.moveaxis(jnp.take(_words(x), ids, axis=axis), axis, 0)
            for name, x in state.planes[kind].items()
        }
    return out


def gather_pages(state: KVDeviceState, request: "GatherRequest | Mapping"):
    """Pure, jittable gather of whole pages for an offload.

    With an offload plan's ``request`` (:attr:`OffloadPlan.request`) returns an
    :class:`OffloadPayload` — the pages' words, the state's applied-work serial (the offload checks
    that the state saw every work it needs) and the plan's identity, which
    :meth:`KVStore.complete_offload` checks.  With a bare ``{PoolKind: int32 (B,)}`` returns
    ``(serial, {PoolKind: {plane: words (B, layers, H, P, X)}})`` (no identity: not a payload an
    offload accepts).
    """
    if isinstance(request, GatherRequest):
        pages = {k: jnp.asarray(v, jnp.int32) for k, v in request.pages.items()}
        return OffloadPayload(jnp.asarray(request.store, jnp.int32), jnp.asarray(request.token, jnp.int32),
                              state.serial, pages, _gather(state, pages))
    return state.serial, _gather(state, request)


gather_pages_jit = jax.jit(gather_pages)


def take_step_work(store, state: KVDeviceState, shapes: "StepWorkShapes | tuple[int, int, int] | None" = None):
    """Take ``store``'s round work for a step that applies works of one fixed shape.

    ``shapes``: a :class:`~ninfer_kv.store.step_shapes.StepWorkShapes` (default
    ``step_work_shapes(store)``), or a bare ``(tables, copies, restores)`` step shape with the default
    alone ladder.  Returns ``(state, work)``: ``work`` padded to the step shape for the step to
    apply; a work that does not fit (COW copies or Host restores after activations, a burst of table
    rows) is padded to the smallest alone shape that holds it and applied first
    (:func:`apply_work_jit`, the returned ``state``), and the step gets the next, empty, take.  So
    the loop compiles at most ``shapes.programs`` work-applying programs, whatever the rounds did.
    """
    shapes = _shapes(store, shapes)
    work = store.take_work()
    if not work.fits(*shapes.step):
        state = apply_work_jit(state, work.pad_to(*shapes.alone_shape(work.counts().values())))
        work = store.take_work()
    return state, work.pad_to(*shapes.step)


def _shapes(store, shapes) -> StepWorkShapes:
    if shapes is None:
        return step_work_shapes(store)
    if isinstance(shapes, StepWorkShapes):
        return shapes
    t, k, r = (int(x) for x in shapes)
    return dataclasses.replace(step_work_shapes(store, tables=t, copies=k, restores=r), step=(t, k, r))
