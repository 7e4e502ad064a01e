"""Allocating a plan's plane buffers on a device.

Planning (:mod:`ninfer_kv.planning`) is arithmetic: it says how many pages each pool has and which
layout they use.  Turning that into ``jax.Array`` buffers is device work and lives here;
``KVPoolSetLayout.allocate(m)`` is a convenience that calls :func:`allocate_pools`.  Each pool's
buffers come from its layout (:meth:`~ninfer_kv.layout.PagedKVStorageLayout.allocate`, the one
place that knows a plane's shape, dtype and fill rule).
"""

from __future__ import annotations

__all__ = ["allocate_pools"]


def allocate_pools(builder, m: int, *, device=None) -> dict:
    """``{PoolKind: {plane name: jax.Array}}``: every pool's planes of ``builder`` (a
    :class:`~ninfer_kv.planning.KVPoolSetLayout`) at ``M = m``, zero-filled, on ``device`` when
    given (block tables are the store's).  Planning is not imported here: it calls this function.
    """
    return {kind: p.layout.allocate(p.physical_pages, device=device) for kind, p in builder.pools(m).items()}
