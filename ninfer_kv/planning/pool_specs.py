"""The pool-kind spec table: one row per growing pool, read by planning, the store and the CLI.

Each :class:`PoolSpec` states, for one :class:`~ninfer_kv.schema.kinds.PoolKind`, everything that differs
between pools:

* ``enabled(spec)`` — whether the speculative config needs it (MTP: method MTP; Draft Full:
  method DFlash or DFlash2 with full-attention draft layers);
* ``layout(model, spec)`` — its plane layout (profile, layers, KV heads, head dim, plane order);
* ``lead_tokens(spec)`` — how many tokens its mapped extent may lead Main's (MTP: the draft window
  minus one), from which its page formula follows: ``N = M + C * ceil(lead / P)``.

A new pool kind is one enum member in :mod:`ninfer_kv.schema.kinds` and one row here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..schema.geometry import PAGE_SIZE, PlaneOrder, ceil_div
from ..schema.kinds import PoolKind, SpeculativeMethod
from ..schema.layout import PagedKVStorageLayout
from ..schema.profiles import KVProfile

__all__ = ["PoolSpec", "POOL_SPECS", "enabled_pools"]


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One pool kind's rules (see the module docstring)."""

    kind: PoolKind
    order: PlaneOrder
    enabled: Callable[[object], bool]
    layout: Callable[[object, object], PagedKVStorageLayout]
    lead_tokens: Callable[[object], int]
    page_formula: str

    def lead_pages(self, spec) -> int:
        """Pages per row the pool may lead Main by: ``ceil(lead_tokens / P)``."""
        return ceil_div(self.lead_tokens(spec), PAGE_SIZE)

    def physical_pages(self, m: int, max_concurrency: int, spec) -> int:
        """Physical pages at Main capacity ``M``: ``M + C * lead_pages``."""
        return m + max_concurrency * self.lead_pages(spec)


def _is_mtp(spec) -> bool:
    return spec.method is SpeculativeMethod.MTP


def _has_draft_full(spec) -> bool:
    return spec.method in (SpeculativeMethod.DFLASH, SpeculativeMethod.DFLASH2) and spec.draft_full_layers > 0


POOL_SPECS: dict[PoolKind, PoolSpec] = {
    PoolKind.MAIN: PoolSpec(
        PoolKind.MAIN, PlaneOrder.PAGE_MAJOR, enabled=lambda spec: True,
        layout=lambda model, spec: PagedKVStorageLayout(model.profile, model.num_layers, model.num_kv_heads,
                                                        model.head_dim),
        lead_tokens=lambda spec: 0, page_formula="M",
    ),
    PoolKind.MTP: PoolSpec(
        PoolKind.MTP, PlaneOrder.PAGE_MAJOR, enabled=_is_mtp,
        layout=lambda model, spec: PagedKVStorageLayout(model.profile, spec.mtp_layers, model.num_kv_heads,
                                                        model.head_dim),
        lead_tokens=lambda spec: spec.draft_window - 1 if _is_mtp(spec) else 0,
        page_formula="M + C * ceil((K - 1) / P)",
    ),
    PoolKind.DRAFT_FULL: PoolSpec(
        PoolKind.DRAFT_FULL, PlaneOrder.HEAD_MAJOR, enabled=_has_draft_full,
        layout=lambda model, spec: PagedKVStorageLayout(
            KVProfile.BF16, spec.draft_full_layers, spec.draft_kv_heads or model.num_kv_heads,
            spec.draft_head_dim or model.head_dim, order=PlaneOrder.HEAD_MAJOR),
        lead_tokens=lambda spec: 0, page_formula="M",
    ),
}
"""Every pool kind's row, in the order pools are planned and listed (Main first)."""


def enabled_pools(spec) -> tuple[PoolKind, ...]:
    """The pools a speculative config needs, Main first."""
    return tuple(kind for kind, row in POOL_SPECS.items() if row.enabled(spec))
