"""The Mosaic TPU backend of the paged ops (registered as ``impl="pallas_tpu"``).

:func:`~pallas_kernels.mosaic_tpu.paged_append.paged_append`,
:func:`~pallas_kernels.mosaic_tpu.paged_attention.paged_attention` and their native ragged forms
:func:`~pallas_kernels.mosaic_tpu.ragged.paged_append_ragged` and
:func:`~pallas_kernels.mosaic_tpu.ragged.paged_attention_ragged` take exactly the arguments of
the reference ops (:mod:`ninfer_kv.ops.reference`) plus keyword-only ``config`` (the common
block-size configs; their ``compiler`` field a :class:`~pallas_kernels.mosaic_tpu.backend.MosaicConfig`
or ``None``) and ``interpret`` (``None``: TPU interpret mode, ``pltpu.InterpretParams()``, unless
the default JAX backend is a TPU).  Every profile runs through its codecs' TPU tiles
(:data:`pallas_kernels.mosaic_tpu.tpu_tiles.TPU_TILES`, one per shared tile of
:data:`pallas_kernels.common.codec_tiles.CODEC_TILES`; the kernels never branch on the codec); both
plane orders are supported.  The
cyclic ops are not provided by this backend (``impl="pallas_tpu"`` raises
``ImplUnavailableError`` for them).

Design (details in each module):

* block tables, rows, positions, lengths and the layer are scalar-prefetch operands
  (``PrefetchScalarGridSpec``, SMEM; the tables flattened to 1-D);
* the stacked planes stay in HBM (``memory_space=pl.ANY``); pages move by
  ``pltpu.make_async_copy`` into VMEM scratch, double-buffered in attention (page ``i + 1`` in
  flight while page ``i`` is computed); the append reads each touched ``(64, X)`` page, merges
  the new rows and writes the page back (a DMA into tiled HBM starts at a tile boundary);
* every VMEM tile's last two dims are a whole ``(64, X)`` page tile or a whole ``(rows, D)``
  block, so they satisfy the TPU (8, 128) tiling rule by being full extents (64 is a multiple of
  the sublane tile of 32-, 16- and 8-bit dtypes); the small scale planes are their own ``(64,
  X)`` DMAs, lane-padded to 128 in VMEM only;
* the ragged forms (:mod:`pallas_kernels.mosaic_tpu.ragged`) run the same two kernels over the
  round's row blocks (:mod:`pallas_kernels.common.ragged`: decode rows one token per block, chunk
  rows in ``block_q``-token blocks for attention and page blocks for the append), the blocks' rows,
  positions, lengths and counts as scalar-prefetch operands; two ``pallas_call`` s per op.
"""

from .backend import MosaicConfig
from .paged_append import paged_append
from .paged_attention import paged_attention
from .ragged import paged_append_ragged, paged_attention_ragged

__all__ = ["paged_append", "paged_attention", "paged_append_ragged", "paged_attention_ragged", "MosaicConfig"]
