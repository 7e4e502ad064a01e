"""Entitlement: how many Device pages an active address space is guaranteed to obtain.

* Default (``kv_lease_growth=False``): activation reserves the prompt plus the full output budget.
* ``kv_lease_growth=True``: activation reserves the current frontier plus a bounded window
  (default 4096 tokens) plus a per-lane cushion.  :meth:`KVStore.round_boundary` grows the window
  at decode-round boundaries; when the pool cannot grow it the lane is reported ``length_limited``
  and the engine ends it with finish reason ``length`` at the covered frontier (bounded
  completion).  The cushion is the part of the reservation that guarantees the step about to be
  launched and one forced control span; shortfall never surfaces as an exception inside a step.

Per pool, the entitlement in tokens is the Main figure plus the pool's provisional lead (MTP may
lead Main by ``draft_window - 1`` tokens), capped at the logical capacity ``L * P``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..schema.geometry import PAGE_SIZE, ceil_div

__all__ = ["EntitlementPolicy", "RoundGrant", "pages_for_tokens"]


def pages_for_tokens(tokens, page_size: int = PAGE_SIZE):
    """``ceil(tokens / P)`` for ints or integer arrays."""
    if isinstance(tokens, np.ndarray):
        return -(-tokens // page_size)
    return ceil_div(int(tokens), page_size)


@dataclasses.dataclass(frozen=True)
class EntitlementPolicy:
    """How activation and round boundaries size entitlements.

    Attributes:
      kv_lease_growth: lease a bounded window instead of the whole output budget.
      window_tokens: the growth window beyond the current frontier (>= 1).
      cushion_tokens: per-lane cushion beyond the window; also the minimum an activation must get.
    """

    kv_lease_growth: bool = False
    window_tokens: int = 4096
    cushion_tokens: int = PAGE_SIZE

    def __post_init__(self):
        for name, low in (("window_tokens", 1), ("cushion_tokens", 0)):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name}={v!r} is invalid; it must be an integer >= {low}")

    def activation_tokens(self, prompt_tokens: int, target_tokens: int) -> tuple[int, int]:
        """(minimum, desired) Main entitlement in tokens at activation."""
        if not self.kv_lease_growth:
            return target_tokens, target_tokens
        minimum = min(target_tokens, prompt_tokens + self.cushion_tokens)
        desired = min(target_tokens, prompt_tokens + self.window_tokens + self.cushion_tokens)
        return minimum, desired

    def desired_tokens(self, committed: np.ndarray, target: np.ndarray) -> np.ndarray:
        """Main entitlement in tokens a growth lane wants at a round boundary."""
        return np.minimum(target, committed + (self.window_tokens + self.cushion_tokens))


@dataclasses.dataclass(frozen=True)
class RoundGrant:
    """The outcome of :meth:`KVStore.round_boundary` for the lanes it examined.

    Attributes:
      rows: the execution rows examined.
      covered_tokens: the Main frontier each lane's entitlement covers (never beyond its target).
      length_limited: lanes whose entitlement cannot cover the next step; end them with finish
        reason ``length`` at their committed frontier (bounded completion).
      granted_pages: pages added to each pool's entitlement, per lane.
    """

    rows: np.ndarray
    covered_tokens: np.ndarray
    length_limited: np.ndarray
    granted_pages: dict
