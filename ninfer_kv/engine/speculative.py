"""Speculative decoding with a model's MTP head: the host bookkeeping of the engine's MTP rounds.

The MTP head's KV at position ``i`` is computed from the pair ``(h_i, t_{i+1})``: the main model's
hidden state at ``i`` and the token after it, so the MTP pool trails Main.  A sequence keeps its
main hidden states (:class:`HiddenStates`, one float32 row of ``d_model`` per position) and its MTP
committed frontier; the pairs in ``[mtp_frontier, frontier)`` whose next token is known are
*pending*:

* after a prefill chunk, ``mtp_extend`` writes the pending pairs (a decoding sequence keeps its
  last pair pending: the next draft extends it and drafts from its output);
* an MTP round runs ``mtp_draft`` (extend the pending pairs, draft ``K`` tokens; MTP leads Main by
  ``K - 1`` provisional positions) and ``verify`` (Main checks the drafts); Main commits the
  accepted tokens and the bonus token, MTP commits the pairs it extended, both trim their tails;
* a retained sequence keeps its hidden states with its prefix-cache entry, so a request that forks
  it at any token ``m`` has ``h_{q} .. h_{m-1}`` for the pairs from the MTP frontier ``q`` the store
  continues at (``min(m - 1, the checkpoint's MTP frontier)``).  Host memory: ``4 * d_model`` bytes
  per cached token, with this method only.

Verification accepts a draft iff it equals the token the request's sampling chooses at that
position (greedy, or the sampled token with the request's key), so every request produces exactly
the tokens of plain decoding.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HiddenStates", "pending_pairs"]


class HiddenStates:
    """Main hidden states of positions ``[0, len)`` of one sequence (float32 ``(len, d)``), grown by
    appending; the rows of a cache entry it forked are shared, not copied."""

    __slots__ = ("_rows", "_len", "_shared")

    def __init__(self, d_model: int, initial: np.ndarray | None = None):
        if initial is None:
            self._rows = np.zeros((0, int(d_model)), np.float32)
        else:
            self._rows = initial
        self._len = int(self._rows.shape[0])
        self._shared = initial is not None

    def __len__(self) -> int:
        return self._len

    def extend(self, rows: np.ndarray) -> None:
        """Append the hidden states of the next ``len(rows)`` positions."""
        rows = np.asarray(rows, np.float32)
        need = self._len + rows.shape[0]
        if self._shared or need > self._rows.shape[0]:
            grown = np.zeros((max(need, 2 * self._rows.shape[0], 64), self._rows.shape[1]), np.float32)
            grown[: self._len] = self._rows[: self._len]
            self._rows, self._shared = grown, False
        self._rows[self._len: need] = rows
        self._len = need

    def window(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` (a view)."""
        if not 0 <= lo <= hi <= self._len:
            raise IndexError(f"hidden states [{lo}, {hi}) requested, {self._len} held")
        return self._rows[lo:hi]

    def frozen(self, length: int) -> np.ndarray:
        """A read-only copy of rows ``[0, length)`` (kept with a cache entry)."""
        out = np.array(self.window(0, length), np.float32)
        out.flags.writeable = False
        return out


def pending_pairs(frontier: int, known_tokens: int, mtp_frontier: int, keep_last: bool) -> int:
    """MTP pairs ready to write: positions ``[mtp_frontier, p)`` where ``p <= frontier`` and the
    token after ``p - 1`` is known; a decoding sequence (``keep_last``) leaves its last pair for the
    next draft."""
    ready = min(frontier, known_tokens - 1) - mtp_frontier
    if keep_last:
        ready -= 1
    return max(0, ready)
