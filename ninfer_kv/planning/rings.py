"""Window rings: the per-row KV of sliding-window layers, outside the growing pools.

A layer with a sliding window ``W`` lets a query at position ``p`` see the keys ``p - W < j <= p``
only.  Such layers need neither a growing pool nor page bookkeeping: each execution row owns a
fixed ring of ``k`` pages per windowed layer, and logical block ``b`` of the row's sequence lives in
ring page ``b mod k`` (the contract's cyclic per-row state, held in pages so the paged ops serve it
unchanged).  A step that writes at most ``T`` tokens per row at positions ``c .. c + T - 1`` reads
keys back to ``c - W + 1``: ``W + T - 1`` positions, which touch at most
``ceil((W + T - 2) / P) + 1`` blocks, no two of them the same ring page when ``k`` is that count.

So the ring of a row holds ``k = ceil((W + T - 2) / 64) + 1`` pages (:attr:`WindowRings.pages_per_row`),
whatever the context: a Gemma-3-shaped model (window 1024, ``T = 512``) keeps 25 pages (1,600
tokens) per windowed layer and row, against 512 pages at a 32K context in the Main pool.

The ring's block table is not state: entry ``(r, b)`` is ``r * k + b mod k`` wherever Main's entry
``(r, b)`` maps a page, and the sentinel where it does not (:func:`ninfer_kv.ops.views.ring_table`
computes it inside the step from Main's table), so a ring is written and read exactly where
Main's bookkeeping lets the row write and read, a poisoned state's sentinel tables stop both, and
a stale step never reaches another row's ring.

A ring does not outlive its row: the next sequence on the row overwrites it.  So that a later
sequence can resume where a retained one stopped, a plan may hold **snapshot slots**
(``WindowRings(snapshots=N)``): ``N`` more rings after the rows' (slot ``s`` owns pages
``[(C + s) * k, (C + s + 1) * k)``), into which a row's ring is copied whole when its sequence is
retained, and from which a new row's ring is copied back when a sequence resumes there (the same
``b mod k`` placement, so neither copy rotates anything).  A snapshot taken at frontier ``c`` holds
the positions from ``low = max(0, ceil(c / 64) - k) * 64`` on, so a sequence may resume from it at
any ``m <= c`` whose window ``[max(0, m - W + 1), m)`` starts at ``low`` or later, ``m = c`` included
(:meth:`WindowRings.resumable`).
"""

from __future__ import annotations

import dataclasses

from ..schema.geometry import PAGE_SIZE, ceil_div
from ..schema.layout import PagedKVStorageLayout
from ..schema.profiles import KVProfile
from .bounds import MAX_CONTEXT, MAX_LAYERS, MAX_PAGES, PlanBoundError, _int_at_least

__all__ = ["WindowRings", "RingPlan", "DEFAULT_RING_STEP_TOKENS"]

DEFAULT_RING_STEP_TOKENS = 512
"""Default ``T`` of :class:`WindowRings`: the most tokens a row writes in one step."""


@dataclasses.dataclass(frozen=True)
class WindowRings:
    """The windowed layers of a model and the step size their rings must absorb.

    Attributes:
      num_layers: windowed layers (each one layer of the ring planes), in ``[1, MAX_LAYERS]``.
      window: ``W``, the largest window of them in tokens, in ``[1, MAX_CONTEXT]``.
      step_tokens: ``T``, the most tokens one step writes into one row, in ``[1, MAX_CONTEXT]``
        (default :data:`DEFAULT_RING_STEP_TOKENS`); a step that writes more into a row would
        overwrite keys its own earlier queries still see, so the step API and the engine refuse it.
      snapshots: snapshot slots (module docstring), in ``[0, MAX_CONTEXT]``; default 0.

    Raises:
      PlanBoundError: a count that is not an integer or is outside its range.
    """

    num_layers: int
    window: int
    step_tokens: int = DEFAULT_RING_STEP_TOKENS
    snapshots: int = 0

    def __post_init__(self):
        _int_at_least("window layers", self.num_layers, 1, MAX_LAYERS)
        _int_at_least("window", self.window, 1, MAX_CONTEXT, "windows are token counts")
        _int_at_least("step_tokens", self.step_tokens, 1, MAX_CONTEXT, "positions are int32")
        _int_at_least("snapshots", self.snapshots, 0, MAX_CONTEXT)

    @property
    def pages_per_row(self) -> int:
        """``k = ceil((W + T - 2) / 64) + 1``: ring pages per row (module docstring)."""
        return ceil_div(max(self.window + self.step_tokens - 2, 0), PAGE_SIZE) + 1

    @property
    def ring_tokens(self) -> int:
        """Tokens a row's ring holds: ``pages_per_row * 64``."""
        return self.pages_per_row * PAGE_SIZE

    def snapshot_low(self, frontier: int) -> int:
        """The first position a snapshot taken at ``frontier`` holds: ``max(0, ceil(c / 64) - k) * 64``."""
        return max(0, ceil_div(frontier, PAGE_SIZE) - self.pages_per_row) * PAGE_SIZE

    def resumable(self, frontier: int, m: int) -> bool:
        """Whether a sequence may resume at ``m`` from a snapshot taken at ``frontier``: ``m <= frontier``
        and every key its windows see before ``m``, ``[max(0, m - W + 1), m)``, is in the snapshot
        (from ``low`` on; always so at ``m == frontier``)."""
        first = max(0, m - self.window + 1)  # the window before m is [first, m): empty when first >= m
        return 0 <= m <= frontier and (first >= m or first >= self.snapshot_low(frontier))

    def layout(self, profile: KVProfile, num_kv_heads: int, head_dim: int) -> PagedKVStorageLayout:
        """The ring planes' layout: page-major, ``num_layers`` layers, Main's profile and geometry."""
        return PagedKVStorageLayout(profile, self.num_layers, num_kv_heads, head_dim)

    def plan(self, profile: KVProfile, num_kv_heads: int, head_dim: int, rows: int) -> "RingPlan":
        """The :class:`RingPlan` for ``rows`` execution rows (and the snapshot slots)."""
        pages = (rows + self.snapshots) * self.pages_per_row
        if pages > MAX_PAGES:
            raise PlanBoundError(
                "max_concurrency", rows, f"at most {MAX_PAGES // self.pages_per_row - self.snapshots} rows",
                f"the window rings hold (max_concurrency + {self.snapshots} snapshots) * {self.pages_per_row} pages, "
                f"whose IDs must fit int32",
            )
        return RingPlan(self, self.layout(profile, num_kv_heads, head_dim), rows, pages)

    def to_json(self) -> dict:
        """Layers, window, step tokens and pages per row, JSON-ready."""
        return {"layers": self.num_layers, "window": self.window, "step_tokens": self.step_tokens,
                "snapshots": self.snapshots, "pages_per_row": self.pages_per_row}


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """The window rings of a plan: ``(rows + snapshots) * pages_per_row`` pages of ``layout``, allocated once.

    Attributes:
      spec: the :class:`WindowRings`.
      layout: the ring planes' :class:`~ninfer_kv.schema.layout.PagedKVStorageLayout`.
      rows: execution rows ``C`` (row ``r`` owns pages ``[r * k, (r + 1) * k)``; snapshot slot ``s``
        the ring ``C + s``).
      physical_pages: ``(C + snapshots) * k``.
    """

    spec: WindowRings
    layout: PagedKVStorageLayout
    rows: int
    physical_pages: int

    @property
    def pages_per_row(self) -> int:
        """``k``, ring pages per row."""
        return self.spec.pages_per_row

    @property
    def slots(self) -> int:
        """Rings in the planes: the rows' and the snapshot slots (``rows + snapshots``)."""
        return self.rows + self.spec.snapshots

    @property
    def bytes(self) -> int:
        """Bytes of the ring planes (a fixed part of every ``B(M)``)."""
        return self.layout.buffer_bytes(self.physical_pages)

    @property
    def row_bytes(self) -> int:
        """Bytes one row's rings hold (every windowed layer)."""
        return self.layout.buffer_bytes(self.pages_per_row)

    def to_json(self) -> dict:
        """The spec, rows, pages and bytes, JSON-ready."""
        return {**self.spec.to_json(), "rows": self.rows, "physical_pages": self.physical_pages,
                "page_bytes": self.layout.page_bytes, "bytes": self.bytes}

