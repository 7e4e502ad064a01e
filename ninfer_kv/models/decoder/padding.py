"""Padding rows for the step functions.

A step compiles once per (bucket, chunk length).  A batch of ``n`` rows runs in the smallest
bucket ``>= n`` (:func:`ninfer_kv.schema.buckets.bucket_for`); the extra rows are *padding rows*::

    tokens 0, positions 0, valid 0, table_rows = scratch_row

A padding row is harmless by construction of the ops' contract:

* ``valid == 0``: ``paged_append`` writes nothing for the row, whatever its table row maps to, so
  the scratch row may be any execution row ``[0, C)`` — even one leased to a live sequence;
* ``positions == 0`` and ``kv_lens = positions + valid == 0``: no key is visible, so attention
  reads no page and returns zeros; the row's logits are finite and ignored by the caller;
* rows never interact (attention, norms and the MLP are per row), so real rows are bit-for-bit
  unaffected by padding rows.

All arrays are built as fresh int32 numpy arrays; hand them to a step and do not mutate them
afterwards (a host buffer given to a step may be read asynchronously).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["PaddedRows", "pad_rows", "RaggedRows", "pad_ragged", "prompt_chunks"]


class PaddedRows(NamedTuple):
    """Step inputs padded to a bucket: rows ``[0, num_real)`` are real, the rest are padding rows."""

    tokens: np.ndarray  # int32 (bucket, T)
    positions: np.ndarray  # int32 (bucket,)
    valid: np.ndarray  # int32 (bucket,)
    table_rows: np.ndarray  # int32 (bucket,)
    num_real: int


def _int_vector(name: str, x, n: int) -> np.ndarray:
    a = np.asarray(x)
    if a.shape != (n,) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be an integer vector of shape ({n},), got shape {a.shape} dtype {a.dtype}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} has values outside int32")
    return a.astype(np.int32)


def pad_rows(tokens, positions, valid, table_rows, *, bucket: int, scratch_row: int = 0) -> PaddedRows:
    """Pad ``n`` real rows up to ``bucket`` rows with padding rows (see the module docstring).

    Args:
      tokens: integer ``(n, T)``; positions, valid, table_rows: integer ``(n,)``.
      bucket: the target batch size (``>= n``).
      scratch_row: the execution row padding rows point at (any row in ``[0, C)``).
    """
    tok = np.asarray(tokens)
    if tok.ndim != 2 or not np.issubdtype(tok.dtype, np.integer):
        raise ValueError(f"tokens must be an integer (n, T) array, got shape {tok.shape} dtype {tok.dtype}")
    n, t = tok.shape
    if not isinstance(bucket, (int, np.integer)) or bucket < max(n, 1):
        raise ValueError(f"bucket={bucket!r} must be an integer >= the number of real rows {n} (and >= 1)")
    if not isinstance(scratch_row, (int, np.integer)) or scratch_row < 0:
        raise ValueError(f"scratch_row={scratch_row!r} must be an integer >= 0")
    out_tok = np.zeros((bucket, t), np.int32)
    out_tok[:n] = tok
    pos = np.zeros((bucket,), np.int32)
    pos[:n] = _int_vector("positions", positions, n)
    val = np.zeros((bucket,), np.int32)
    val[:n] = _int_vector("valid", valid, n)
    if np.any(val[:n] < 0) or np.any(val[:n] > t):
        raise ValueError(f"valid must lie in [0, {t}] (the chunk length), got {val[:n].tolist()}")
    rows = np.full((bucket,), scratch_row, np.int32)
    rows[:n] = _int_vector("table_rows", table_rows, n)
    return PaddedRows(out_tok, pos, val, rows, int(n))


class RaggedRows(NamedTuple):
    """Ragged-step inputs padded to a batch bucket and a token bucket: rows ``[0, num_real)`` are
    real; the padding rows own no token; tokens past the last row are padding."""

    tokens: np.ndarray  # int32 (token_bucket,)
    positions: np.ndarray  # int32 (bucket,)
    query_starts: np.ndarray  # int32 (bucket + 1,)
    table_rows: np.ndarray  # int32 (bucket,)
    num_real: int


def pad_ragged(tokens, lengths, positions, table_rows, *, bucket: int, token_bucket: int,
               scratch_row: int = 0) -> RaggedRows:
    """Pad a ragged batch of ``n`` rows (row ``r``'s ``lengths[r]`` tokens one after another in
    ``tokens``) up to ``bucket`` rows and ``token_bucket`` tokens.

    Padding rows (position 0, no token, table row ``scratch_row``) and padding tokens (id 0) write
    nothing and read nothing; their outputs must be ignored.
    """
    tok = np.asarray(tokens)
    if tok.ndim != 1 or not np.issubdtype(tok.dtype, np.integer):
        raise ValueError(f"tokens must be an integer (N,) array, got shape {tok.shape} dtype {tok.dtype}")
    lens = np.asarray(lengths)
    if lens.ndim != 1 or not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(f"lengths must be an integer (n,) vector, got shape {lens.shape} dtype {lens.dtype}")
    n = lens.size
    lens = _int_vector("lengths", lens, n)
    if np.any(lens < 0) or int(lens.sum()) != tok.size:
        raise ValueError(f"lengths must be >= 0 and sum to the {tok.size} tokens, got {lens.tolist()}")
    if not isinstance(bucket, (int, np.integer)) or bucket < max(n, 1):
        raise ValueError(f"bucket={bucket!r} must be an integer >= the number of real rows {n} (and >= 1)")
    if not isinstance(token_bucket, (int, np.integer)) or token_bucket < max(tok.size, 1):
        raise ValueError(f"token_bucket={token_bucket!r} must be an integer >= the {tok.size} tokens (and >= 1)")
    if not isinstance(scratch_row, (int, np.integer)) or scratch_row < 0:
        raise ValueError(f"scratch_row={scratch_row!r} must be an integer >= 0")
    out_tok = np.zeros((token_bucket,), np.int32)
    out_tok[: tok.size] = tok
    starts = np.full((bucket + 1,), tok.size, np.int32)
    starts[: n + 1] = np.concatenate([[0], np.cumsum(lens)])
    pos = np.zeros((bucket,), np.int32)
    pos[:n] = _int_vector("positions", positions, n)
    rows = np.full((bucket,), scratch_row, np.int32)
    rows[:n] = _int_vector("table_rows", table_rows, n)
    return RaggedRows(out_tok, pos, starts, rows, int(n))


def prompt_chunks(prompt_len: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, valid)`` of each prefill chunk covering ``prompt_len`` tokens (last chunk partial)."""
    if not isinstance(prompt_len, (int, np.integer)) or prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len!r} must be an integer >= 1")
    if not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be an integer >= 1")
    return [(s, min(chunk, prompt_len - s)) for s in range(0, prompt_len, chunk)]
