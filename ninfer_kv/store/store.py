"""KVStore: the program-level facade over every growing pool (Python bookkeeping).

The store keeps, per enabled pool (one per :class:`~ninfer_kv.schema.kinds.PoolKind` of the plan), a
:class:`DevicePagePool`, the logical page descriptors, the address spaces, its own copy of the
``int32 (C, L)`` block-table matrix and the pool's pending page writes.  It decides Move / Fork /
COW from the real references and keeps every transition atomic across pools.  It holds no
``jax.Array`` and launches no device work: the caller owns a :class:`KVDeviceState` and applies the
store's round work inside its own jitted step.

Life of a sequence::

    state = allocate_state(store)                  # planes + block tables, caller-owned (ninfer_kv.device)
    h = store.activate(prompt_tokens, max_new_tokens, source=ckpt_or_None, release_source=False)
    store.map(h, n)                                # before a unit that writes up to n tokens
    work = store.take_work()                       # table rows, COW copies, Host restores
    state, out = step(state, work, ...)            # the jitted step runs apply_work(state, work) first
    store.commit(h, frontier)                      # only after the unit succeeded (or rows, frontiers)
    store.settle(h, accepted, provisional=...)     # speculative: commit accepted, trim rejected tails
    ckpt = store.finish(h, retain=True, state_image=token)   # or retain=False
    store.release_checkpoint(ckpt)

The verb families live in their own modules: :mod:`.activation` (activate, finish, release),
:mod:`.row_verbs` (map / commit / trim / settle, by rows or by handle),
:mod:`.host_verbs` (the Host tier) and :mod:`.inspection` (summaries, invariants, snapshots).

The store is composed over one explicit :class:`~ninfer_kv.store.core.StoreCore`: each verb family
is its own class over that core (``ActivationVerbs``, ``RowVerbs``, ``HostVerbs``, ``WorkVerbs``,
``InspectionVerbs``), and :class:`KVStore` is their union, so every verb is an ordinary method with
its own signature and documentation.
"""

from __future__ import annotations

from ..planning import KVPlan, KVPoolSetLayout
from .activation import ActivationVerbs
from .core import FaultInjector, StoreCore
from .entitlement import EntitlementPolicy
from .frontier_history import DEFAULT_WINDOW
from .host_verbs import HostVerbs
from .inspection import InspectionVerbs
from .row_verbs import RowVerbs
from .work_verbs import WorkVerbs

__all__ = ["KVStore"]


def _core_attribute(name: str, doc: str, settable: bool = False) -> property:
    def get(self):
        return getattr(self._core, name)

    get.__doc__ = doc

    def set_(self, value):
        setattr(self._core, name, value)

    return property(get, set_ if settable else None, doc=doc)


class KVStore(ActivationVerbs, RowVerbs, HostVerbs, WorkVerbs, InspectionVerbs):
    """The KV store (Python bookkeeping) over the pools of a plan.

    Args:
      plan: a :class:`KVPlan` (from ``plan_kv_cache``) or a :class:`KVPoolSetLayout` with ``m``.
      m: Main pages when ``plan`` is a :class:`KVPoolSetLayout`.
      entitlement: the :class:`EntitlementPolicy` (default: full prompt + output budget).
      requires_state_image: the model needs a state image to resume from a frontier (e.g. it has
        recurrent state).  Then ``finish(retain=True)`` must be given one; KV alone is not a hit.
      device: default device of :func:`~ninfer_kv.device.allocate_state` and of a Host arena made from
        ``host_bytes``.
      fault_injector: test hook ``f(stage, pool)`` called before each activation stage and each
        Host transfer stage (``OFFLOAD_STAGES``, ``RESTORE_STAGES``).
      host_arena: a :class:`~ninfer_kv.host.HostKVArena` for the Host replica tier (shared by every
        pool; it must be empty: the store allocates and frees every extent in it).
      host_bytes: alternatively, the capacity of a new arena for ``device``.  Neither: no Host tier.
      history_window: takes a device state may lag behind the store and still be repaired by
        :func:`~ninfer_kv.resync` without treating recent content as lost (see
        :mod:`~ninfer_kv.store.frontier_history`; memory ``window * C * 8`` bytes per pool).
      identity: the store identity its works, states and offload payloads carry (default: a fresh
        one per store; a :class:`ShardedKVStore` gives every shard its own).
    """

    def __init__(
        self,
        plan: "KVPlan | KVPoolSetLayout",
        m: int | None = None,
        *,
        entitlement: EntitlementPolicy | None = None,
        requires_state_image: bool = False,
        device=None,
        fault_injector: FaultInjector | None = None,
        host_arena=None,
        host_bytes: int | None = None,
        history_window: int = DEFAULT_WINDOW,
        identity: int | None = None,
    ):
        if isinstance(plan, KVPlan):
            if m is not None and m != plan.m:
                raise ValueError(f"m={m} disagrees with the plan's M={plan.m}")
            pool_set, pools = plan.pool_set, plan.pools
        elif isinstance(plan, KVPoolSetLayout):
            if m is None:
                raise ValueError("a KVPoolSetLayout needs m (Main pages)")
            pool_set, pools = plan, plan.pools(m)
        else:
            raise TypeError(f"plan must be a KVPlan or KVPoolSetLayout, got {type(plan).__name__}")
        arena = self._make_arena(host_arena, host_bytes, device)
        self._core = core = StoreCore(
            pool_set,
            pools,
            policy=entitlement or EntitlementPolicy(),
            requires_state_image=requires_state_image,
            device=device,
            fault_injector=fault_injector,
            arena=arena,
            history_window=history_window,
            identity=identity,
        )

    @staticmethod
    def _make_arena(host_arena, host_bytes, device):
        if host_arena is not None and host_bytes is not None:
            raise ValueError("pass either host_arena or host_bytes, not both")
        if host_bytes is not None:
            from ..host import HostKVArena
            from ..schema.sizes import byte_count

            # an integer, a whole-number float or a byte-size string such as "64MiB"
            return HostKVArena(byte_count(host_bytes, "host_bytes", minimum=1), device=device)
        return host_arena

    # -- the plan's numbers and the core's state -----------------------------------------------------
    pool_set = _core_attribute("pool_set", "The :class:`KVPoolSetLayout` the store was planned with.")
    pool_plans = _core_attribute("pool_plans", "``{PoolKind: PoolPlan}`` of every enabled pool.")
    max_context = _core_attribute("max_context", "The per-sequence ceiling ``S`` in tokens.")
    max_concurrency = _core_attribute("max_concurrency", "Execution rows ``C``.")
    logical_pages = _core_attribute("logical_pages", "Logical blocks ``L = ceil(S / P)`` per address space.")
    page_size = _core_attribute("page_size", "Tokens per page ``P`` (64).")
    policy = _core_attribute("policy", "The :class:`EntitlementPolicy`.")
    requires_state_image = _core_attribute("requires_state_image", "Whether a retained checkpoint needs a state image.")
    device = _core_attribute(
        "device", "Default device of :func:`~ninfer_kv.device.allocate_state` and of an arena made from ``host_bytes``."
    )
    identity = _core_attribute(
        "identity", "Identity carried by this store's works, states and offload payloads (>= 1)."
    )
    work_serial = _core_attribute(
        "work_serial", "Round works handed out so far (a state that applied all of them has this ``serial``)."
    )
    pool_kinds = _core_attribute("pool_kinds", "The enabled pools, Main first.")
    stats = _core_attribute(
        "stats", "Host transfer counters (``offloaded_pages``, ``restored_pages``, ...; zeros without a Host tier)."
    )
    fault_injector = _core_attribute(
        "fault_injector",
        "Test hook ``f(stage, pool)`` called before each activation and Host transfer stage.",
        settable=True,
    )

    def sequences(self) -> list:
        """Handles of every active sequence (quarantined ones included)."""
        return self._core.sequences()

    def checkpoints(self) -> list:
        """Handles of every retained checkpoint (quarantined ones included)."""
        return self._core.checkpoints()

    # the core's tables, for tests and debugging (not an interface: the verbs are)
    _rt = property(lambda self: self._core.runtimes)
    _main = property(lambda self: self._core.main)
    _rows = property(lambda self: self._core.rows)
    _registry = property(lambda self: self._core.registry)
    _host = property(lambda self: self._core.host)

    def __repr__(self) -> str:
        return self.describe()
