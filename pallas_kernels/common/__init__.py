"""The backend-neutral parts of the Pallas kernels, for every kernel backend (``pallas_kernels/<backend>/``).

Nothing here imports Pallas or names a backend: it is ``jax.numpy`` / ``jax.lax`` arithmetic on
values a kernel has already loaded, and the rules every backend obeys.

* :mod:`~pallas_kernels.common.limits`: the head dims every backend supports.
* :mod:`~pallas_kernels.common.config`: the block-size configs of the four ops and their
  resolution (a backend's own compiler knobs ride in their ``compiler`` field).
* :mod:`~pallas_kernels.common.tiles`: lane sets of tiles (:class:`~pallas_kernels.common.tiles.Cols`),
  a backend's lane padding rule (:class:`~pallas_kernels.common.tiles.Lanes`) and the masked
  reductions and products on tiles.
* :mod:`~pallas_kernels.common.codec_tiles`: one tile object per codec (encode, decode keys, decode
  values) in the table :data:`~pallas_kernels.common.codec_tiles.CODEC_TILES`.
* :mod:`~pallas_kernels.common.softmax`: the online-softmax arithmetic of attention and the merge of
  context splits.
* :mod:`~pallas_kernels.common.ragged`: the cut of a ragged call into the blocks the native ragged
  kernels' programs handle (decode rows, chunk rows in query blocks or page blocks), the chunk
  block size rule, and the gather of per-block outputs back to tokens.
"""
