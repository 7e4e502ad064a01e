"""Errors raised by the KV store and the device layer (a leaf module: it imports nothing).

Every error is raised *before* any state changes (validation first), or after a full rollback
(activation), so a caught error always leaves the store exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "KVStoreError",
    "StaleHandleError",
    "PoolCapacityError",
    "EntitlementError",
    "LifecycleError",
    "IncompleteContinuationError",
    "InvariantError",
    "HostCapacityError",
    "StaleReplicaError",
    "RowError",
    "WorkOrderError",
    "PendingWorkError",
    "DonatedStateError",
    "LostContentError",
    "PayloadError",
    "TargetError",
]


class KVStoreError(RuntimeError):
    """Base class of every KV-store error."""


class StaleHandleError(KVStoreError, KeyError):
    """A handle, lease, page or address-space view is unknown, or its generation is outdated."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class PoolCapacityError(KVStoreError):
    """A pool cannot supply the pages (or the execution rows) a request needs."""


class HostCapacityError(PoolCapacityError):
    """The Host arena cannot place the extents an offload needs (exhaustion or fragmentation).

    Raised after :meth:`HostKVArena.validate_plan` rejected the whole allocation recipe, before
    anything changed.  The allocator's own error (with the requested bytes, largest free extent
    and free bytes) is the ``__cause__``.
    """


class EntitlementError(KVStoreError, ValueError):
    """A mapping or commit target exceeds an address space's entitlement or mapped extent."""


class RowError(KVStoreError, ValueError):
    """A row verb named an execution row that is not leased to an active sequence (idle, out of
    range, negative) or named one row twice in one call."""


class LifecycleError(KVStoreError):
    """An operation does not fit the object's state (double finish, commit going backwards, ...)."""


class IncompleteContinuationError(LifecycleError):
    """A retain or reuse would publish KV pages without the rest of their continuation."""


class StaleReplicaError(LifecycleError):
    """A replica no longer matches its page's canonical content (epoch or committed coverage moved).

    Raised by the verify step of a Host transfer; nothing is published and the transfer's
    reservations are undone.
    """


class InvariantError(KVStoreError, AssertionError):
    """An internal consistency check failed (a bug, never a user error)."""


class WorkOrderError(KVStoreError):
    """A device state did not receive the store's round works in order (one was skipped or applied
    twice), or it was poisoned by such a mismatch inside a jitted step."""


class PendingWorkError(WorkOrderError):
    """A step read the planes or block tables of a :class:`~ninfer_kv.KVDeviceState` whose round work
    (taken with :func:`~ninfer_kv.take_step_work`) it had not applied, or a new work was taken for such
    a state; raised on the host or at trace time, before anything runs.  Apply the work first:
    ``state = apply_work(state, work)`` inside the step."""


class DonatedStateError(KVStoreError, ValueError):
    """A :class:`~ninfer_kv.KVDeviceState` whose buffers were donated to a jitted step (or deleted)
    was used again; the step's returned state is the one to use."""


class LostContentError(LifecycleError):
    """A :func:`~ninfer_kv.resync` found that the device no longer holds some of this sequence's or
    checkpoint's committed content (its works were skipped and cannot be replayed).

    The handle stays valid but is quarantined: its rows are inert on the device and every verb
    refuses it except ``finish(retain=False)`` / ``release_checkpoint`` and, for a sequence,
    ``truncate`` back to the intact frontier the resync reported (which returns it to service).
    """


class PayloadError(KVStoreError, ValueError):
    """An offload payload does not belong to the plan it completes (another plan's, another store's,
    or other pages); nothing was published and the plan is still in flight."""


class TargetError(KVStoreError, ValueError):
    """A row or handle verb named a token target (map target, frontier, kept tokens) that is negative or
    beyond the logical capacity ``L * P``; the error names the row and the value."""
