"""The numpy model of the four ops, out-of-range rules included (the oracle of the kernel tests).

Written from the op contract (``ninfer_kv.ops`` module docstring) over the numpy codec oracle
(:mod:`.np_codecs`), one token or one key at a time, sharing no code with any backend:

* ``paged_append`` — row ``b`` writes token ``t < clip(valid[b], 0, T)`` at logical position
  ``p = positions[b] + t``: block ``p // 64``, column ``p % 64`` of table row ``table_rows[b]``.
  Nothing is written for a table row outside ``[0, C)``, a position outside ``[0, L * 64)`` or a
  table entry outside ``[0, N)``.
* ``paged_attention`` — key ``j`` of row ``b`` is visible to query ``t`` iff the table row is in
  ``[0, C)``, the entry of block ``j // 64`` is in ``[0, N)``, ``j < clip(kv_lens[b], 0, L * 64)``
  and ``j <= positions[b] + t``; query head ``hq`` reads KV head ``hq // (Hq // H)``; a query with
  no visible key yields zeros.
* ``cyclic_append`` — token ``t < clip(valid[b], 0, T)`` of ring row ``rows[b]`` goes to slot
  ``(positions[b] + t) % slots`` in order (when a chunk wraps the ring the later token stays);
  a ring row outside ``[0, rows)`` or a negative position writes nothing.
* ``cyclic_attention`` — key ``j`` (read from slot ``j % slots``) is visible to query ``t`` iff
  the ring row is in range, ``0 <= j < kv_lens[b]`` and ``p - window < j <= p``,
  ``p = positions[b] + t``.

Appends return new numpy planes; attention returns float64 ``(B, T, Hq, D)``.
"""

from __future__ import annotations

import numpy as np

from ninfer_kv.schema.geometry import PlaneOrder

from . import np_codecs

PAGE = 64


def _token_heads(planes: dict, order, layer: int, page: int, col: int) -> dict:
    """The ``(H, X)`` codes of one (page, column) of every plane."""
    if PlaneOrder(order) is PlaneOrder.PAGE_MAJOR:
        return {name: x[layer, page, :, col] for name, x in planes.items()}
    return {name: x[layer, :, page, col] for name, x in planes.items()}


def _put(planes: dict, order, layer: int, page: int, col: int, codes: dict) -> None:
    for name, x in planes.items():
        if PlaneOrder(order) is PlaneOrder.PAGE_MAJOR:
            x[layer, page, :, col] = codes[name]
        else:
            x[layer, :, page, col] = codes[name]


def _clip_valid(valid, t: int) -> np.ndarray:
    return np.clip(np.asarray(valid, np.int64), 0, t)


def paged_writes(block_tables, table_rows, positions, valid, t: int, num_pages: int) -> list[tuple[int, int, int, int]]:
    """``(batch row, token, page, column)`` of every token an append writes, in order."""
    tables = np.asarray(block_tables, np.int64)
    c, nblk = tables.shape
    out = []
    for b, (row, pos0, n) in enumerate(zip(np.asarray(table_rows, np.int64), np.asarray(positions, np.int64),
                                           _clip_valid(valid, t))):
        if not 0 <= row < c:
            continue
        for tt in range(int(n)):
            p = int(pos0) + tt
            if not 0 <= p < nblk * PAGE:
                continue
            page = int(tables[row, p // PAGE])
            if 0 <= page < num_pages:
                out.append((b, tt, page, p % PAGE))
    return out


def ragged_rows(x: np.ndarray, starts, lengths) -> np.ndarray:
    """The ragged tokens ``x (N, ...)`` as rectangular rows ``(R, max(lengths), ...)``: row ``r`` holds
    tokens ``[starts[r], starts[r] + lengths[r])``, zeros past its length."""
    out = np.zeros((len(lengths), max(1, int(np.max(lengths, initial=0)))) + x.shape[1:], x.dtype)
    for r, length in enumerate(lengths):
        out[r, :length] = x[starts[r]:starts[r] + length]
    return out


def paged_append(planes: dict, layout, layer: int, block_tables, table_rows, positions, k, v, valid) -> dict:
    """The planes after ``paged_append`` (the inputs are not modified)."""
    out = {name: np.array(x, copy=True) for name, x in planes.items()}
    codes = np_codecs.encode_kv(layout.profile, k, v)
    num_pages = next(iter(planes.values())).shape[PlaneOrder(layout.order).page_axis]
    for b, tt, page, col in paged_writes(block_tables, table_rows, positions, valid, np.shape(k)[1], num_pages):
        _put(out, layout.order, layer, page, col, {name: c[b, tt] for name, c in codes.items()})
    return out


def paged_keys(planes: dict, layout, layer: int, block_tables, table_rows, kv_lens):
    """Oracle-decoded K, V ``(B, L * 64, H, D)`` of every logical position of each batch row, and
    ``readable (B, L * 64)``: the row, the block's page and ``j < clip(kv_len)`` are all in range."""
    tables = np.asarray(block_tables, np.int64)
    c, nblk = tables.shape
    num_pages = next(iter(planes.values())).shape[PlaneOrder(layout.order).page_axis]
    rows = np.asarray(table_rows, np.int64)
    lens = np.clip(np.asarray(kv_lens, np.int64), 0, nblk * PAGE)
    b = rows.size
    readable = np.zeros((b, nblk * PAGE), bool)
    codes = {}
    for i in range(b):
        if not 0 <= rows[i] < c:
            continue
        for j in range(int(lens[i])):
            page = int(tables[rows[i], j // PAGE])
            if not 0 <= page < num_pages:
                continue
            readable[i, j] = True
            for name, x in _token_heads(planes, layout.order, layer, page, j % PAGE).items():
                codes.setdefault(name, np.zeros((b, nblk * PAGE) + x.shape, x.dtype))[i, j] = x
    if not codes:  # nothing readable anywhere
        shape = (b, nblk * PAGE, layout.num_kv_heads, layout.head_dim)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32), readable
    k, v = np_codecs.decode_kv(layout.profile, codes)
    return k, v, readable


def causal_visible(readable: np.ndarray, positions, t: int) -> np.ndarray:
    """bool ``(B, T, J)``: key ``j`` readable and ``j <= positions[b] + t``."""
    qpos = np.asarray(positions, np.int64)[:, None] + np.arange(t)[None, :]
    j = np.arange(readable.shape[1])
    return readable[:, None, :] & (j[None, None, :] <= qpos[:, :, None])


def default_scale(head_dim: int, sm_scale) -> float:
    """The score scale: ``sm_scale``, or ``1 / sqrt(head_dim)`` when it is ``None``."""
    return 1.0 / np.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def paged_attention(q, planes: dict, layout, layer: int, block_tables, table_rows, positions, kv_lens,
                    sm_scale=None, window=None, soft_cap=None, sinks=None) -> np.ndarray:
    """float64 output of ``paged_attention`` (``q`` in any float dtype, read as float32); with a
    ``window``, key ``j`` is visible to a query at ``p`` only when ``j > p - window``."""
    q = np.asarray(q).astype(np.float32)
    k, v, readable = paged_keys(planes, layout, layer, block_tables, table_rows, kv_lens)
    visible = causal_visible(readable, positions, q.shape[1])
    if window is not None:
        qpos = np.asarray(positions, np.int64)[:, None] + np.arange(q.shape[1])[None, :]
        visible &= np.arange(readable.shape[1])[None, None, :] > qpos[:, :, None] - window
    return np_codecs.attention(q, k, v, visible, default_scale(q.shape[-1], sm_scale), soft_cap,
                               None if sinks is None else np.asarray(sinks, np.float64))


def cyclic_append(planes: dict, layout, layer: int, rows, positions, k, v, valid) -> dict:
    """The planes after ``cyclic_append`` (planes ``(layers, rows, H, slots, X)``)."""
    out = {name: np.array(x, copy=True) for name, x in planes.items()}
    codes = np_codecs.encode_kv(layout.profile, k, v)
    for b, (row, pos0, n) in enumerate(zip(np.asarray(rows, np.int64), np.asarray(positions, np.int64),
                                           _clip_valid(valid, np.shape(k)[1]))):
        if not 0 <= row < layout.rows:
            continue
        for tt in range(int(n)):
            p = int(pos0) + tt
            if p < 0:
                continue
            for name, x in out.items():
                x[layer, row, :, p % layout.slots] = codes[name][b, tt]
    return out


def cyclic_attention(q, planes: dict, layout, layer: int, rows, positions, kv_lens, sm_scale=None) -> np.ndarray:
    """float64 output of ``cyclic_attention``: each row reads the ``window + T - 1`` keys its
    queries may see, from the slots they live in."""
    q = np.asarray(q).astype(np.float32)
    b, t = q.shape[:2]
    span = layout.window + t - 1
    rows = np.asarray(rows, np.int64)
    first = np.asarray(positions, np.int64) - layout.window + 1  # oldest key query 0 may see
    keys = first[:, None] + np.arange(span)[None, :]  # (B, span) absolute key positions
    ok = (rows[:, None] >= 0) & (rows[:, None] < layout.rows) & (keys >= 0)
    ok &= keys < np.asarray(kv_lens, np.int64)[:, None]
    slot = np.where(keys >= 0, keys, 0) % layout.slots
    ring = np.clip(rows, 0, layout.rows - 1)
    codes = {name: x[layer][ring[:, None], :, slot] for name, x in planes.items()}  # (B, span, H, X)
    k, v = np_codecs.decode_kv(layout.profile, codes)
    qpos = np.asarray(positions, np.int64)[:, None] + np.arange(t)[None, :]  # (B, T)
    visible = ok[:, None, :] & (keys[:, None, :] <= qpos[:, :, None]) & (keys[:, None, :] > qpos[:, :, None] - layout.window)
    return np_codecs.attention(q, k, v, visible, default_scale(q.shape[-1], sm_scale))
