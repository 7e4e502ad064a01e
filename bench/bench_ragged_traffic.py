"""KV-cache bytes each ragged paged attention kernel reads per round, next to the ideal (no hardware).

Every count is derived from a kernel's grid, block sizes and load / DMA schedule; nothing runs on
a device and nothing is timed.  Only KV-cache bytes are counted (the K and V code planes and their
scale planes); queries, outputs, block-table entries (4 bytes per page) and split partials are not.

Geometry (Llama-3-8B-like, one layer: the 32 layers scale every kernel alike): 8 KV heads, 32
query heads (GQA group 4), head dim 128, 64-token pages, the profile's planes (``--profile``, any
of the five; default ``bf16``).  The bytes of a (token, KV head) and of a (page, KV head) come from
``PagedKVStorageLayout(profile, 1, 8, 128).plane_shapes / plane_dtypes`` (K and V codes plus their
scale planes).  Block tables are ``--max-model-len`` tokens wide (default 8192; 128 pages).

Rounds (rows in this order, each row its own table row; decode rows first):

``a``   64 decodes at 2K context: each row ``kv_len`` 2048, one query at position 2047.
``b``   8 decodes at 4K context (``kv_len`` 4096, query at 4095) and one 1024-token prefill chunk:
        the chunk is positions [3072, 4096) of a 4096-token prompt (``kv_len`` 4096), i.e. the last
        chunk of a prompt, the one that sees the most context.
``b0``  the same with the chunk at [0, 1024) (``kv_len`` 1024): the first chunk of a prompt.
``c``   one 8192-token prefill in 1024-token chunks: 8 calls, chunk ``i`` at positions
        [1024 i, 1024 (i + 1)) with ``kv_len`` 1024 (i + 1); the sum of the 8 calls.

Kernels (each ``(block, KV head)`` program's reads, summed over the grid):

``ideal (triton blocks)`` / ``ideal (mosaic blocks)``
    Every live page read once per KV head per query block, the query blocks being one native
    kernel's (decode rows: one block of one token; chunk rows: ``block_q``-token blocks from the
    row's first token).  The two native kernels cut chunk rows differently
    (``pallas_kernels.common.ragged.chunk_block_q`` with each kernel's default query rows): Triton's
    ``pallas_kernels.triton.ragged.chunk_rows`` (128 query rows for head dims up to 128: 32 tokens at
    GQA 4), Mosaic's ``pallas_kernels.mosaic_tpu.ragged.CHUNK_ROWS`` (256 query rows: 64 tokens at
    GQA 4), both capped at ``next_pow2(N)`` and both replaced by ``--block-q``
    (``PagedAttentionConfig.block_q``, which both honour).  The bench calls those functions for
    ``block_q`` (it does not restate their rules); the ideal itself is
    plain integer arithmetic on that ``block_q``, independent of the kernels' block code.  A
    block's live pages are the pages below ``ceil(min(kv_len, last query position + 1) / 64)``.
    The ``row floor`` reads each row's live pages once per KV head (one query block per row); it
    is printed for reference only.
``triton rows`` / ``triton pages``
    The native Triton ragged kernel (``pallas_kernels/triton/ragged.py``): its blocks are
    ``pallas_kernels.common.ragged.decode_blocks`` and ``chunk_blocks`` called on the round's
    arrays, with ``block_k`` / ``k_splits`` from ``PagedAttentionConfig.resolve`` (decode class:
    ``num_queries=1, batch=`` the decode block bound; chunk class: ``num_queries=N, batch=1`` at its
    ``block_q``), and each program's key range is ``attention_program``'s:
    ``hi = min(kv_len, first position + count)``, ``lo = 0``, steps of ``block_k`` keys divided
    among ``k_splits`` programs (no step is read twice), masked loads of the keys in ``[lo, hi)``
    (keys at or past ``hi`` are not read).  ``rows`` counts the key rows loaded, ``pages`` the
    64-token pages those rows touch.  Inert blocks (``rows = -1``) read nothing.  With a sliding
    window (``triton_native(..., window=W)``; no command-line flag, the rounds are full attention)
    ``lo = max(0, first position - W + 1)`` and the steps start at the one holding ``lo``, the
    config resolved for ``min(max_keys, W + num_queries - 1)`` keys as the kernel does
    (``pallas_kernels.triton.attention.resolution_keys``); ``ideal_pages(..., window=W)`` counts a
    block's pages from the one holding its first query's first visible key.
``mosaic``
    The native Mosaic TPU ragged kernel (``pallas_kernels/mosaic_tpu/ragged.py``): the same decode
    blocks, and chunk blocks from ``chunk_blocks`` at its own ``block_q``; each ``(block, KV head)`` program of ``attention_blocks`` (with its per-block
    ``counts``) DMAs whole 64-token pages of every plane, one page per step (``block_k`` is not
    used; the rounds table shows ``k64 s1``), the pages below
    ``ceil(hi / 64)`` with ``hi = min(kv_len, position + count)`` (0 for an inert block); the
    double buffer starts page ``i + 1`` only when it is below that bound, so nothing more moves.
``generic rows`` / ``generic pages``
    The generic form (``ninfer_kv/ops/ragged.py``): ``token_rows`` makes every token a row of one
    query of the rectangular kernel, reading its row's keys up to its own position
    (``hi = min(kv_len, position + 1)``; the Triton rectangular kernel resolves ``block_q = 1``
    there).  ``rows``: the Triton rectangular kernel's key rows; ``pages``: whole pages, as the
    rectangular Mosaic kernel reads them.
``jax rpa``
    ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (its ``kernel.py``): grid
    ``(num_q_heads / num_q_heads_per_blk, cdiv(N, num_queries_per_block))``; the heads block is
    ``get_min_heads_per_blk`` (here all 8 KV heads, K and V interleaved in one
    ``[pages, 64, 2 * 8, 128]`` array, so one DMA per page carries K and V of every head).  Each
    query block walks every sequence that has a token in it, and for each such sequence the kv
    blocks ``0, 1, ...`` while ``kv_block * pages_per_block * 64 < kv_len`` - the sequence's whole
    ``kv_len``, not the block's causal frontier - and every kv block DMAs all
    ``num_kv_pages_per_block`` pages (pages past the sequence's last page fetch its page 0
    instead).  The count below replays those ``while`` loops.  Its bytes are given on this
    profile's pages (the same bytes per page as ours, scale planes included; RPA itself stores one
    dtype with scalar ``k_scale`` / ``v_scale``: the JSON's ``rpa_native_bytes`` are for its own
    ``kv_pages`` dtype, bf16 / int8 / fp8 / fp4, fp8 for K8V4's mixed codecs).  RPA places a
    row's queries at the end of its ``kv_len`` (true of every round here).  Its query blocks
    (32 tokens) are larger than Triton's (16) and smaller than Mosaic's (64), so on chunk rows it
    can read less than ``ideal (triton blocks)`` but not less than ``ideal (mosaic blocks)``.
    Block sizes: ``table`` is what the kernel picks with ``num_kv_pages_per_block`` and
    ``num_queries_per_block`` left ``None`` - ``get_tuned_block_sizes``'s table for
    ``--rpa-device`` (default ``TPU v6``) at this geometry, ``N`` and table width, else its
    untuned default (128 pages, 32 queries; 32 x 32 on TPU v4), clipped to the table width and
    ``N``; with the default 8192-token table width there is no tuned entry: 128 pages x 32 queries.
    ``--rpa PAGESxQUERIES`` adds fixed settings (default ``16x32``: the table's entry for this
    head geometry at page 64 and a 1024-token table width, the largest kv block it tunes there).

The append (``append``): the round's ``N`` tokens written once, K and V with their scales, as a
share of the Triton kernel's attention bytes (``triton rows``).  ``append (mosaic)`` is the Mosaic
ragged append's traffic: each of its programs reads one page whole and writes it back (one window:
a decode row's page, or one of the chunk rows' ``page_blocks``, cut at page boundaries, so no
``block_q`` enters it), as a share of the ``mosaic`` attention bytes (which do depend on the
chunk ``block_q``: the larger Mosaic blocks make the share larger).  The append's K/V inputs are
not counted (they are not KV cache).

Ratios (the bytes table): ``x ideal`` is to the ideal named in its ``of`` column: each of our
kernels to the ideal of its own query blocks (``triton rows`` and ``triton pages`` to ``ideal
(triton blocks)``, ``mosaic`` to ``ideal (mosaic blocks)``), every other row to ``ideal (triton
blocks)`` (``ideal (mosaic blocks)`` there shows how much Mosaic's larger blocks save).  Our kernels PASS when within ``--limit`` (default 1.25x) of their own ideal on the
round (``--check`` too).  ``x rpa table`` / ``x rpa PAGESxQUERIES`` are each row's bytes over
JAX's RPA at that setting (below 1: fewer bytes than RPA).

Usage::

    python bench/bench_ragged_traffic.py                       # bf16, tables
    python bench/bench_ragged_traffic.py --profile k8v4        # any of the five profiles
    python bench/bench_ragged_traffic.py --json                # the same numbers as JSON
    python bench/bench_ragged_traffic.py --check               # exit 1 if one of ours exceeds the limit
    python bench/bench_ragged_traffic.py --block-k 128 --rpa 8x64 --rpa 32x16 --rounds a b
    python bench/bench_ragged_traffic.py --block-q 32              # both kernels' chunk blocks of 32 tokens

The exit status is 0 (it is a report) unless ``--check`` finds one of our kernels over the limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the working tree's packages, not an installed copy
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing here runs on a device; the block arrays are tiny

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa_kernel
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
    tuned_block_sizes as rpa_tuned,
)

from ninfer_kv.cli import render_table
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.ops.ragged import token_rows
from ninfer_kv.schema.profiles import KVCodec, KVProfile
from pallas_kernels.common import ragged
from pallas_kernels.common.config import PagedAttentionConfig
from pallas_kernels.mosaic_tpu.ragged import CHUNK_ROWS as MOSAIC_CHUNK_ROWS
from pallas_kernels.triton.attention import resolution_keys as triton_resolution_keys
from pallas_kernels.triton.ragged import chunk_rows as triton_chunk_rows

MIB = float(1 << 20)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _call_blocks(table_rows, positions, kv_lens, starts, n: int, page: int) -> dict:
    """The kernels' own block arrays of one call that do not depend on ``block_q`` (``jax.numpy`` on small
    arrays; one compile per shape): the attention's decode blocks, the append's page blocks, the generic
    form's token rows."""
    return {"decode": ragged.decode_blocks(table_rows, positions, kv_lens, starts, n),
            "append decode": ragged.decode_blocks(table_rows, positions, jnp.zeros_like(kv_lens), starts, n),
            "append chunk": ragged.page_blocks(table_rows, positions, starts, n, page),
            "tokens": token_rows(table_rows, positions, starts, n)}


@functools.partial(jax.jit, static_argnums=(4, 5))
def _chunk_blocks(table_rows, positions, kv_lens, starts, n: int, block_q: int):
    """The attention's chunk blocks of one call at ``block_q`` (each native kernel passes its own)."""
    return ragged.chunk_blocks(table_rows, positions, kv_lens, starts, n, block_q)


def _np(blocks):
    return type(blocks)(*(np.asarray(x, np.int64) for x in blocks))


@functools.cache
def call_blocks(call: Call, page: int) -> dict:
    """:func:`_call_blocks` of ``call`` as numpy int64 arrays (named tuples kept)."""
    return {k: _np(v) for k, v in _call_blocks(*call.arrays(), call.num_tokens, page).items()}


@functools.cache
def chunk_blocks(call: Call, block_q: int):
    """:func:`_chunk_blocks` of ``call`` as numpy int64 arrays (named tuple kept)."""
    return _np(_chunk_blocks(*call.arrays(), call.num_tokens, block_q))


NATIVE = ("triton", "mosaic")
IDEAL = {k: f"ideal ({k} blocks)" for k in NATIVE}
OURS = {"triton rows": "triton", "triton pages": "triton", "mosaic": "mosaic"}  # each of ours -> its own blocks


# -- geometry ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The model's attention geometry (one layer) and the pool's profile."""

    profile: KVProfile = KVProfile.BF16
    kv_heads: int = 8
    q_heads: int = 32
    head_dim: int = 128
    max_model_len: int = 8192  # block-table width in tokens

    @property
    def layout(self) -> PagedKVStorageLayout:
        return PagedKVStorageLayout(self.profile, 1, self.kv_heads, self.head_dim)

    @property
    def page(self) -> int:
        return self.layout.page_size

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def table_pages(self) -> int:
        return -(-self.max_model_len // self.page)

    @property
    def max_keys(self) -> int:
        return self.table_pages * self.page

    @property
    def page_head_bytes(self) -> int:
        """Bytes of one (page, KV head) over every plane, from the layout's plane shapes and dtypes."""
        lay = self.layout
        shapes, dtypes = lay.plane_shapes(1), lay.plane_dtypes()
        total = sum(math.prod(shapes[n]) * np.dtype(dtypes[n]).itemsize for n in lay.plane_names)
        return total // self.kv_heads

    @property
    def token_head_bytes(self) -> int:
        return self.page_head_bytes // self.page

    def plane_summary(self) -> str:
        lay = self.layout
        shapes, dtypes = lay.plane_shapes(1), lay.plane_dtypes()
        return " + ".join(f"{n} {np.dtype(dtypes[n]).name}[{shapes[n][-1]}]" for n in lay.plane_names)


# -- rounds ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """One ragged call: row ``r`` has ``lengths[r]`` tokens from ``positions[r]`` and ``kv_lens[r]`` keys."""

    positions: tuple[int, ...]
    lengths: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def arrays(self):
        """``table_rows, positions, kv_lens, query_starts`` as the ragged ops take them (row r -> table row r)."""
        starts = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)
        return (np.arange(self.num_rows, dtype=np.int32), np.asarray(self.positions, np.int32),
                np.asarray(self.kv_lens, np.int32), starts)


@dataclasses.dataclass(frozen=True)
class Round:
    name: str
    label: str
    calls: tuple[Call, ...]


def decodes(n: int, context: int) -> Call:
    return Call((context - 1,) * n, (1,) * n, (context,) * n)


def join(*calls: Call) -> Call:
    return Call(sum((c.positions for c in calls), ()), sum((c.lengths for c in calls), ()),
                sum((c.kv_lens for c in calls), ()))


def chunk(start: int, length: int, kv_len: int) -> Call:
    return Call((start,), (length,), (kv_len,))


ROUNDS = {
    "a": Round("a", "64 decodes @ 2K", (decodes(64, 2048),)),
    "b": Round("b", "8 decodes @ 4K + chunk [3072,4096)", (join(decodes(8, 4096), chunk(3072, 1024, 4096)),)),
    "b0": Round("b0", "8 decodes @ 4K + chunk [0,1024)", (join(decodes(8, 4096), chunk(0, 1024, 1024)),)),
    "c": Round("c", "8192-token prefill, 8 chunks of 1024 (sum)",
               tuple(chunk(1024 * i, 1024, 1024 * (i + 1)) for i in range(8))),
}


# -- the kernels' reads, in (token, KV head) rows and (page, KV head) pages -----------------------------------------


def _pages(n):
    """Pages holding the keys ``[0, n)``: ``ceil(n / 64)`` (numpy-friendly)."""
    return -(-np.maximum(np.asarray(n, np.int64), 0) // 64)


def native_block_q(geo: Geometry, config: PagedAttentionConfig, call: Call, kernel: str) -> int:
    """The chunk class's ``block_q`` of a native kernel (``"triton"`` or ``"mosaic"``), as its
    ``paged_attention_ragged`` resolves it: :func:`~pallas_kernels.common.ragged.chunk_block_q` with
    the kernel's default rows (Triton: :func:`~pallas_kernels.triton.ragged.chunk_rows`; Mosaic:
    :data:`~pallas_kernels.mosaic_tpu.ragged.CHUNK_ROWS`)."""
    if kernel not in NATIVE:
        raise ValueError(f"kernel {kernel!r} is not one of {NATIVE}")
    rows = triton_chunk_rows(geo.head_dim) if kernel == "triton" else MOSAIC_CHUNK_ROWS
    return ragged.chunk_block_q(config, rows=rows, num_tokens=call.num_tokens, group=geo.group,
                                head_dim=geo.head_dim, kv_heads=geo.kv_heads, max_keys=geo.max_keys)


def ideal_pages(geo: Geometry, call: Call, block_q: int, window: int | None = None) -> int:
    """Page-heads of the ideal: each block's live pages once per KV head (plain integer arithmetic);
    with a ``window`` a block's live pages start at the one holding its first query's first visible key."""
    total = 0
    for pos, n, kv in zip(call.positions, call.lengths, call.kv_lens):
        blocks = [(0, 1)] if n == 1 else [(s, min(block_q, n - s)) for s in range(0, n, block_q)]
        for first, count in blocks:
            hi = min(kv, pos + first + count)  # last query position + 1
            lo = 0 if window is None else max(0, pos + first - window + 1)
            total += -(-hi // geo.page) - lo // geo.page if hi > lo else 0
    return total * geo.kv_heads


def floor_pages(geo: Geometry, call: Call) -> int:
    """Page-heads when each row's live pages are read once per KV head (one query block per row)."""
    return sum(-(-max(0, min(kv, pos + n)) // geo.page) for pos, n, kv in zip(call.positions, call.lengths,
                                                                                 call.kv_lens)) * geo.kv_heads


@dataclasses.dataclass
class NativeClass:
    """One ``pallas_call`` of the native ragged attention: its blocks (numpy) and resolved config."""

    name: str
    rows: np.ndarray
    positions: np.ndarray
    kv_lens: np.ndarray
    counts: np.ndarray
    block_q: int
    block_k: int
    k_splits: int


@functools.cache
def native_classes(geo: Geometry, config: PagedAttentionConfig, call: Call,
                   kernel: str = "triton", window: int | None = None) -> tuple[NativeClass, ...]:
    """The decode and chunk classes of a native kernel's ``paged_attention_ragged`` (``kernel``:
    ``"triton"`` or ``"mosaic"``), blocks from ``pallas_kernels.common.ragged``, the chunk blocks at the
    kernel's own :func:`native_block_q`.  Triton's ``block_k`` / ``k_splits`` are ``resolve``'s at that ``block_q``; Mosaic
    steps one page at a time in one program per block (``block_k`` = page, ``k_splits`` = 1).  ``window``:
    Triton's config is resolved for a windowed call's keys (:func:`~pallas_kernels.triton.attention.resolution_keys`)."""
    n, r = call.num_tokens, call.num_rows
    out = []
    nb_dec = ragged.decode_block_count(r, n)
    blocks = {"decode": call_blocks(call, geo.page)["decode"],
              "chunk": chunk_blocks(call, native_block_q(geo, config, call, kernel))}
    for name, num_queries, batch in (("decode", 1, nb_dec), ("chunk", n, 1)):
        b = blocks[name]
        if kernel == "triton":  # as paged_attention_ragged: the class's block_q, then resolve
            bq = 1 if name == "decode" else native_block_q(geo, config, call, kernel)
            cfg = dataclasses.replace(config, block_q=bq).resolve(
                num_queries=num_queries, group=geo.group, head_dim=geo.head_dim, batch=batch, kv_heads=geo.kv_heads,
                max_keys=triton_resolution_keys(geo.max_keys, window, num_queries))
            block_q, block_k, k_splits = cfg.block_q, cfg.block_k, cfg.k_splits
        else:
            block_q = 1 if name == "decode" else native_block_q(geo, config, call, kernel)
            block_k, k_splits = geo.page, 1
        out.append(NativeClass(name, b.rows, b.positions, b.kv_lens, b.counts,
                               block_q=block_q, block_k=block_k, k_splits=k_splits))
    return tuple(out)


def program_hi(geo: Geometry, rows, positions, kv_lens, counts, row_limit: int) -> np.ndarray:
    """Each program's key bound ``hi = min(kv_len, first position + count)``, ``kv_len`` as ``attention_call``
    clips it (0 for a row outside ``[0, row_limit)``, e.g. an inert block's -1)."""
    row_ok = (rows >= 0) & (rows < row_limit)
    kv = np.where(row_ok, np.clip(np.minimum(kv_lens, geo.max_keys), 0, None), 0)
    return np.minimum(kv, positions + counts)


def program_lo(positions, window: int | None) -> np.ndarray:
    """Each program's first key ``lo``: 0, or ``max(0, first position - window + 1)`` with a window."""
    positions = np.asarray(positions, np.int64)
    return np.zeros_like(positions) if window is None else np.maximum(positions - window + 1, 0)


def triton_reads(hi: np.ndarray, block_k: int, k_splits: int, page: int, lo: np.ndarray | None = None) -> tuple[int, int]:
    """Key rows and pages the programs of one (block, KV head) load, summed over blocks and splits:
    ``attention_program``'s step arithmetic (``lo`` 0 unless given, :func:`program_lo`; the steps from
    the one holding ``lo``; masked loads of the keys in ``[lo, hi)``)."""
    lo = np.zeros_like(hi) if lo is None else np.asarray(lo, np.int64)
    step_lo = lo // block_k
    step_hi = np.where(hi > lo, (hi + block_k - 1) // block_k, step_lo)
    per_split = (step_hi - step_lo + k_splits - 1) // k_splits
    rows = pages = 0
    for sp in range(k_splits):
        first = step_lo + sp * per_split
        last = np.maximum(np.minimum(step_hi, first + per_split), first)
        a, b = np.maximum(first * block_k, lo), np.minimum(last * block_k, hi)
        live = b > a
        rows += int(np.where(live, b - a, 0).sum())
        pages += int(np.where(live, -(-b // page) - a // page, 0).sum())
    return rows, pages


def triton_native(geo: Geometry, config: PagedAttentionConfig, call: Call,
                  window: int | None = None) -> tuple[int, int]:
    """Token-heads and page-heads the native Triton ragged attention reads (both classes, all KV heads),
    with a sliding ``window`` when given."""
    rows = pages = 0
    for cls in native_classes(geo, config, call, "triton", window):
        hi = program_hi(geo, cls.rows, cls.positions, cls.kv_lens, cls.counts, call.num_rows)
        r, p = triton_reads(hi, cls.block_k, cls.k_splits, geo.page, program_lo(cls.positions, window))
        rows, pages = rows + r, pages + p
    return rows * geo.kv_heads, pages * geo.kv_heads


def mosaic_native(geo: Geometry, config: PagedAttentionConfig, call: Call, window: int | None = None) -> int:
    """Page-heads of the native Mosaic ragged attention (model): whole pages from the one holding
    ``lo`` (:func:`program_lo`, 0 without a ``window``) below ``ceil(hi / 64)``, none when ``hi <= lo``."""
    total = 0
    for cls in native_classes(geo, config, call, "mosaic", window):
        hi = program_hi(geo, cls.rows, cls.positions, cls.kv_lens, cls.counts, call.num_rows)
        lo = program_lo(cls.positions, window)
        total += int(np.where(hi > lo, _pages(hi) - lo // geo.page, 0).sum())
    return total * geo.kv_heads


def generic_reads(geo: Geometry, config: PagedAttentionConfig, call: Call) -> tuple[int, int]:
    """Token-heads (Triton rectangular kernel) and page-heads (Mosaic rectangular kernel) of the generic
    form: ``token_rows`` gives every token its own row of one query."""
    n = call.num_tokens
    tok = call_blocks(call, geo.page)["tokens"]
    real = tok.real == 1
    lens = np.where(real, np.asarray(call.kv_lens, np.int64)[np.clip(tok.row, 0, call.num_rows - 1)], 0)
    cfg = config.resolve(num_queries=1, group=geo.group, head_dim=geo.head_dim, batch=n, kv_heads=geo.kv_heads,
                         max_keys=geo.max_keys)  # the rectangular kernel's resolution at T = 1: block_q = 1
    assert cfg.block_q == 1
    hi = program_hi(geo, tok.table_rows, tok.positions, lens, np.ones(n, np.int64), call.num_rows)
    rows, _ = triton_reads(hi, cfg.block_k, cfg.k_splits, geo.page)
    pages = int(np.where(hi > 0, _pages(hi), 0).sum())
    return rows * geo.kv_heads, pages * geo.kv_heads


# -- JAX's ragged paged attention ----------------------------------------------------------------------------------

_RPA_DTYPES = {KVCodec.BF16: jnp.bfloat16, KVCodec.INT8_G64: jnp.int8, KVCodec.FP8_E4M3FN_ROW: jnp.float8_e4m3fn,
               KVCodec.NVFP4_G16: jnp.float4_e2m1fn}


def rpa_kv_dtype(profile: KVProfile):
    """RPA's one ``kv_pages`` dtype for a profile (K8V4's mixed codecs: the wider, fp8)."""
    return _RPA_DTYPES[profile.k_codec]


@dataclasses.dataclass(frozen=True)
class RpaSetting:
    name: str
    kv_pages: int | None  # None: the kernel's own choice (get_tuned_block_sizes)
    queries: int | None


def rpa_heads(geo: Geometry) -> tuple[int, int]:
    """``(num_q_heads_per_blk, num_combined_kv_heads_per_blk)`` from the kernel's ``get_min_heads_per_blk``."""
    return rpa_kernel.get_min_heads_per_blk(geo.q_heads, 2 * geo.kv_heads, jnp.bfloat16,
                                            rpa_kv_dtype(geo.profile))


def rpa_block_sizes(geo: Geometry, setting: RpaSetting, num_tokens: int, device: str) -> tuple[int, int, str]:
    """``(num_kv_pages_per_block, num_queries_per_block, source)`` as ``ragged_paged_attention`` takes them:
    given (``"given"``), or ``get_tuned_block_sizes``'s entry for ``device`` (``"tuned"``; its key through the
    module's ``simplify_key``), else its untuned default (``"default"``), clipped to the table and ``N``."""
    if setting.kv_pages is not None and setting.queries is not None:
        return setting.kv_pages, setting.queries, "given"
    q_per_blk, combined = rpa_heads(geo)
    key = rpa_tuned.simplify_key((jnp.bfloat16, rpa_kv_dtype(geo.profile), q_per_blk, combined // 2, geo.head_dim,
                                  geo.page, num_tokens, geo.table_pages))
    table = {} if device == "TPU v4" else rpa_tuned.TUNED_BLOCK_SIZES.get(device, {})
    bkv, bq = table.get(key, (32, 32) if device == "TPU v4" else (128, 32))
    return min(geo.table_pages, bkv), min(num_tokens, bq), "tuned" if key in table else "default"


def rpa_page_dmas(call: Call, kv_pages_per_block: int, queries_per_block: int, page: int) -> int:
    """Page DMAs of one heads block of ``ragged_paged_attention_kernel``: a replay of its loops.

    Grid steps ``q_blk`` run in order; each walks sequences from where the previous one stopped
    (``seq_buf_idx``) while ``is_cur_q_blk_needed``; each sequence's kv blocks run while
    ``kv_blk * pages_per_blk * page < kv_len``, and each kv block is one ``MultiPageAsyncCopyDescriptor``
    of ``pages_per_blk`` page copies (fetched once: the prefetch of step ``i`` is the block step ``i + 1``
    computes, every compute step waits on exactly one).
    """
    for pos, n, kv in zip(call.positions, call.lengths, call.kv_lens):
        if pos + n != kv:
            raise ValueError(f"RPA places a row's queries at the end of its kv_len: position {pos} + {n} != {kv}")
    cu = np.concatenate([[0], np.cumsum(call.lengths)])
    num_seqs, per_blk = call.num_rows, kv_pages_per_block * page
    num_q_blks = -(-call.num_tokens // queries_per_block)
    dmas, seq = 0, 0
    for q_blk in range(num_q_blks):
        q_len_start, q_len_end = q_blk * queries_per_block, (q_blk + 1) * queries_per_block
        done = 0
        while done == 0 and q_len_start < cu[num_seqs] and seq < num_seqs:
            q_end, kv_len = cu[seq + 1], call.kv_lens[seq]
            kv_blk = 0
            while kv_blk * per_blk < kv_len:
                dmas += kv_pages_per_block
                kv_blk += 1
            next_seq = seq + 1 if q_end <= q_len_end else seq
            done = 0 if q_end < q_len_end else 1
            seq = next_seq
        seq = seq if seq < num_seqs else 0
    return dmas


def rpa_reads(geo: Geometry, setting: RpaSetting, call: Call, device: str) -> tuple[int, int, tuple[int, int, str]]:
    """Page-heads RPA's DMAs move (all heads blocks), its native ``kv_pages`` bytes, and its block sizes."""
    bkv, bq, source = rpa_block_sizes(geo, setting, call.num_tokens, device)
    q_per_blk, combined = rpa_heads(geo)
    heads_blks = geo.q_heads // q_per_blk
    pages = rpa_page_dmas(call, bkv, bq, geo.page) * heads_blks * (combined // 2)  # page-heads
    bits = 32 // rpa_kernel.get_dtype_packing(rpa_kv_dtype(geo.profile))
    native = pages * geo.page * 2 * geo.head_dim * bits // 8
    return pages, native, (bkv, bq, source)


# -- appends --------------------------------------------------------------------------------------------------------


def append_token_heads(geo: Geometry, call: Call) -> int:
    """The round's tokens written once (K and V with scales)."""
    return call.num_tokens * geo.kv_heads


def mosaic_append_page_heads(geo: Geometry, call: Call) -> int:
    """Page-heads a whole-page append moves: each decode row's page and each chunk ``page_block`` read and written
    (the page blocks are cut at page boundaries; the attention's ``block_q`` plays no part)."""
    blocks = call_blocks(call, geo.page)  # page blocks: no block_q
    touched = int((blocks["append decode"].rows >= 0).sum() + (blocks["append chunk"].counts > 0).sum())
    return 2 * touched * geo.kv_heads


# -- the report -----------------------------------------------------------------------------------------------------


def measure(geo: Geometry, config: PagedAttentionConfig, rnd: Round, rpa_settings: list[RpaSetting],
            rpa_device: str) -> dict:
    """Bytes per kernel for one round (summed over its calls), plus per-call details."""
    tb, pb = geo.token_head_bytes, geo.page_head_bytes
    totals: dict[str, int] = {}
    extra: dict[str, int] = {}
    calls = []

    def add(key, value, into=totals):
        into[key] = into.get(key, 0) + int(value)

    for call in rnd.calls:
        bq = {k: native_block_q(geo, config, call, k) for k in NATIVE}
        t_rows, t_pages = triton_native(geo, config, call)
        g_rows, g_pages = generic_reads(geo, config, call)
        per = {
            **{IDEAL[k]: ideal_pages(geo, call, bq[k]) * pb for k in NATIVE},
            "row floor": floor_pages(geo, call) * pb,
            "triton rows": t_rows * tb,
            "triton pages": t_pages * pb,
            "mosaic": mosaic_native(geo, config, call) * pb,
            "generic rows": g_rows * tb,
            "generic pages": g_pages * pb,
        }
        rpa_cfg = {}
        for s in rpa_settings:
            pages, native, sizes = rpa_reads(geo, s, call, rpa_device)
            per[s.name] = pages * pb
            add(s.name, native, extra)
            rpa_cfg[s.name] = {"num_kv_pages_per_block": sizes[0], "num_queries_per_block": sizes[1],
                               "source": sizes[2]}
        app = {"append": append_token_heads(geo, call) * tb,
               "append (mosaic)": mosaic_append_page_heads(geo, call) * pb}
        for k, v in {**per, **app}.items():
            add(k, v)
        calls.append({"tokens": call.num_tokens, "rows": call.num_rows, "block_q": bq,
                      "classes": {k: [{"class": c.name, "blocks": int((c.rows >= 0).sum()), "block_q": c.block_q,
                                       "block_k": c.block_k, "k_splits": c.k_splits}
                                      for c in native_classes(geo, config, call, k)] for k in NATIVE},
                      "rpa": rpa_cfg, "bytes": {**per, **app}})
    return {"round": rnd.name, "label": rnd.label, "bytes": totals, "rpa_native_bytes": extra, "calls": calls}


def kernel_names(rpa_settings: list[RpaSetting]) -> list[str]:
    return [*IDEAL.values(), "row floor", *OURS, "generic rows", "generic pages", *(s.name for s in rpa_settings)]


def ideal_of(name: str) -> str:
    """The ideal a row's ``x ideal`` is taken against: each of ours its own kernel's query blocks, every
    other row (the references, and ``ideal (mosaic blocks)`` itself) the Triton / shared ones."""
    return IDEAL[OURS.get(name, "triton")]


def rpa_column(name: str) -> str:
    return name.replace("jax rpa", "x rpa", 1)


def report(geo: Geometry, config: PagedAttentionConfig, rounds: list[Round], rpa_settings: list[RpaSetting],
           rpa_device: str, limit: float) -> dict:
    results = [measure(geo, config, r, rpa_settings, rpa_device) for r in rounds]
    fails = []
    for res in results:
        b = res["bytes"]
        res["ideal_of"] = {k: ideal_of(k) for k in kernel_names(rpa_settings)}
        res["ratio"] = {k: b[k] / b[res["ideal_of"][k]] for k in kernel_names(rpa_settings)}
        res["ratio_rpa"] = {s.name: {k: b[k] / b[s.name] if b[s.name] else math.inf
                                     for k in kernel_names(rpa_settings)} for s in rpa_settings}
        res["pass"] = {k: res["ratio"][k] <= limit for k in OURS}
        res["append_share"] = {"append": b["append"] / b["triton rows"],
                               "append (mosaic)": b["append (mosaic)"] / b["mosaic"]}
        fails += [f"{res['round']}: {k} {res['ratio'][k]:.3f}x" for k in OURS if not res["pass"][k]]
    q_per_blk, combined = rpa_heads(geo)
    return {
        "geometry": {"model": "Llama-3-8B-like, one layer", "kv_heads": geo.kv_heads, "q_heads": geo.q_heads,
                     "group": geo.group, "head_dim": geo.head_dim, "page": geo.page,
                     "max_model_len": geo.max_model_len, "profile": geo.profile.value, "planes": geo.plane_summary(),
                     "token_head_bytes": geo.token_head_bytes, "page_head_bytes": geo.page_head_bytes},
        "config": {"block_q": config.block_q, "block_k": config.block_k, "k_splits": config.k_splits},
        "rpa": {"device": rpa_device, "num_q_heads_per_blk": q_per_blk, "num_combined_kv_heads_per_blk": combined,
                "kv_dtype": np.dtype(rpa_kv_dtype(geo.profile)).name,
                "settings": [dataclasses.asdict(s) for s in rpa_settings]},
        "limit": limit,
        "rounds": results,
        "failures": fails,
    }


def _mib(x: int) -> str:
    return f"{x / MIB:,.2f}"


def render(rep: dict, rpa_settings: list[RpaSetting]) -> str:
    g = rep["geometry"]
    lines = [
        (f"KV-cache bytes read per round ({g['model']}): {g['kv_heads']} KV heads, {g['q_heads']} query heads "
         f"(GQA {g['group']}), head dim {g['head_dim']}, page {g['page']} tokens, tables {g['max_model_len']} tokens"),
        (f"profile {g['profile']}: {g['planes']} = {g['token_head_bytes']} B per (token, KV head), "
         f"{g['page_head_bytes']:,} B per (page, KV head)"),
    ]
    setup = []
    for res in rep["rounds"]:
        c0 = res["calls"][0]
        calls = len(res["calls"])
        cls = {(k, c["class"]): (f"{c['blocks']} x (q{c['block_q']} k{c['block_k']} s{c['k_splits']})"
                                 if c["blocks"] else "-") for k in NATIVE for c in c0["classes"][k]}
        rpa = [f"{v['num_kv_pages_per_block']}p x {v['num_queries_per_block']}q"
               + (f" ({v['source']})" if v["source"] != "given" else "") for v in c0["rpa"].values()]
        setup.append([res["round"], res["label"], f"{calls} x {c0['tokens']}" if calls > 1 else c0["tokens"],
                      *(cls[k, c] for k in NATIVE for c in ("decode", "chunk")), *rpa])
    lines += ["", ("Rounds (per call; native blocks as count x (q block_q, k block_k, s k_splits), block_q in tokens "
                   f"of {g['group']} query rows; each kernel's ideal uses its own query blocks; RPA as kv pages x "
                   "queries per block):"),
              render_table(["round", "rows", "tokens", *(f"{k} {c}" for k in NATIVE for c in ("decode", "chunk")),
                            *(s.name for s in rpa_settings)], setup)]
    rows = []
    for res in rep["rounds"]:
        for k in kernel_names(rpa_settings):
            verdict = ("PASS" if res["pass"][k] else "FAIL") if k in OURS else "-"
            of = res["ideal_of"][k].removeprefix("ideal (").removesuffix(" blocks)")
            rows.append([res["round"], k, _mib(res["bytes"][k]), f"{res['ratio'][k]:.3f}", of,
                         *(f"{res['ratio_rpa'][s.name][k]:.3f}" for s in rpa_settings), verdict])
    rpa_cols = [rpa_column(s.name) for s in rpa_settings]
    lines += ["", ("Bytes per kernel: x ideal against the ideal of the query blocks in 'of' (ours: their own; the "
                   "references: triton's); x rpa against JAX's RPA at that setting "
                   "(< 1: fewer bytes than RPA):"),
              render_table(["round", "kernel", "MiB read", "x ideal", "of", *rpa_cols, f"<= {rep['limit']:g}x"],
                           rows, right=[2, 3, *range(5, 5 + len(rpa_cols))])]
    app = []
    for res in rep["rounds"]:
        b, s = res["bytes"], res["append_share"]
        app.append([res["round"], res["label"], _mib(b["triton rows"]), _mib(b["append"]), f"{100 * s['append']:.3f} %",
                    _mib(b["mosaic"]), _mib(b["append (mosaic)"]), f"{100 * s['append (mosaic)']:.3f} %"])
    lines += ["", "Append per round (tokens written once; Mosaic: touched pages read and written whole):",
              render_table(["round", "rows", "triton attn MiB", "append MiB", "share", "mosaic attn MiB",
                            "mosaic append MiB", "share"], app, right=[2, 3, 4, 5, 6, 7])]
    lines.append("")
    lines.append(f"ours within {rep['limit']:g}x of their own ideal on every round: "
                 + ("yes" if not rep["failures"] else "NO (" + "; ".join(rep["failures"]) + ")"))
    return "\n".join(lines)


def _rpa_setting(text: str) -> RpaSetting:
    try:
        pages, queries = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rpa {text!r}: expected PAGESxQUERIES, e.g. 16x32") from None
    if pages < 1 or queries < 1:
        raise argparse.ArgumentTypeError(f"--rpa {text!r}: both must be >= 1")
    return RpaSetting(f"jax rpa {pages}x{queries}", pages, queries)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="bf16", help="KV profile (bf16, int8-g64, fp8-e4m3fn-row256, nvfp4-g16, "
                                                     "k8v4 or an alias; default bf16)")
    p.add_argument("--rounds", nargs="+", choices=list(ROUNDS), default=list(ROUNDS), help="rounds (default all)")
    p.add_argument("--max-model-len", type=int, default=8192, help="block-table width in tokens (default 8192)")
    p.add_argument("--block-q", type=int, default=None,
                   help="PagedAttentionConfig.block_q: both native kernels' chunk block_q in tokens (default: each "
                        "kernel's own rule, Triton 128 query rows at D <= 128, Mosaic 256)")
    p.add_argument("--block-k", type=int, default=64, help="PagedAttentionConfig.block_k (default 64)")
    p.add_argument("--k-splits", type=int, default=None, help="PagedAttentionConfig.k_splits (default: resolved)")
    p.add_argument("--rpa", type=_rpa_setting, action="append", default=None, metavar="PAGESxQUERIES",
                   help="fixed RPA (num_kv_pages_per_block x num_queries_per_block) settings, repeatable "
                        "(default 16x32); the kernel's own table choice is always shown")
    p.add_argument("--rpa-device", default="TPU v6",
                   choices=["TPU v4", *rpa_tuned.TUNED_BLOCK_SIZES], help="tuned table RPA looks up (default TPU v6)")
    p.add_argument("--limit", type=float, default=1.25, help="PASS limit of our kernels' ratio to ideal (1.25)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--check", action="store_true", help="exit 1 if one of our kernels exceeds the limit")
    args = p.parse_args(argv)

    geo = Geometry(profile=KVProfile.parse(args.profile), max_model_len=args.max_model_len)
    longest = max(kv for r in args.rounds for c in ROUNDS[r].calls for kv in c.kv_lens)
    if geo.max_keys < longest:
        p.error(f"--max-model-len {args.max_model_len} is below the rounds' longest kv_len {longest}")
    config = PagedAttentionConfig(block_q=args.block_q, block_k=args.block_k, k_splits=args.k_splits)
    rpa_settings = [RpaSetting("jax rpa table", None, None), *(args.rpa or [_rpa_setting("16x32")])]
    try:
        rep = report(geo, config, [ROUNDS[r] for r in args.rounds], rpa_settings, args.rpa_device, args.limit)
    except ValueError as e:  # e.g. --block-q past a program's query rows
        p.error(str(e))
    print(json.dumps(rep, indent=1) if args.json else render(rep, rpa_settings))
    return 1 if args.check and rep["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
