"""The Triton kernel backend: Pallas on NVIDIA GPUs through the Triton lowering (interpret mode on a CPU).

* :mod:`~pallas_kernels.triton.paged_append`, :mod:`~pallas_kernels.triton.paged_attention`,
  :mod:`~pallas_kernels.triton.cyclic`: the four ops (the ``"pallas"`` implementation of
  :mod:`ninfer_kv.ops`) and their addressers / key sources (block-table lookups, ring slots);
* :mod:`~pallas_kernels.triton.ragged`: the native ragged append and attention (a round's decode
  rows and chunk rows as two grids of row blocks over the same kernel bodies);
* :mod:`~pallas_kernels.triton.append`, :mod:`~pallas_kernels.triton.attention`: the kernel bodies
  shared by the paged and the cyclic ops (loads, stores and program structure around the codec
  tiles and the online softmax of :mod:`pallas_kernels.common`);
* :mod:`~pallas_kernels.triton.backend`: the Pallas surface (masked gathers and scatters, program
  ids, ``pallas_call``); no other module of this backend imports Pallas;
* :mod:`~pallas_kernels.triton.config`: the Triton compiler knobs (``TritonConfig``: warps, stages)
  and tile rules (powers of two, product operands >= 16);
* :mod:`~pallas_kernels.triton.addressing`: 64-bit element offsets for large planes, scoped to the
  lowering of these kernels.
"""
