"""Pallas kernels for ninfer_kv's paged and cyclic append and attention ops.

The package root is the ``"pallas"`` implementation that the op registry names
(:mod:`ninfer_kv.ops.registry`, registered by :mod:`ninfer_kv.ops.dispatch` as
``"pallas_kernels:<op>"``): the four ops on the Triton backend, their configs and the head-dim
limit.  The ops take exactly the arguments of the reference implementations in
:mod:`ninfer_kv.ops.reference`, plus keyword-only ``config`` (a frozen block-size dataclass whose
``compiler`` field holds a :class:`TritonConfig` or ``None``; ``config=None`` picks defaults from
the shapes) and ``interpret`` (``None``: run the Pallas interpreter iff the default JAX backend is
the CPU).  Inputs are assumed validated by :mod:`ninfer_kv.ops`.

* :func:`paged_append` / :func:`cyclic_append` quantize in the kernel and write in place (the planes
  are aliased input -> output; donate them in the calling ``jax.jit``).
* :func:`paged_append_ragged` / :func:`paged_attention_ragged`: the ragged forms, natively (a static
  grid over the round's row blocks, :mod:`pallas_kernels.triton.ragged`).
* :func:`paged_attention` / :func:`cyclic_attention` read pages through the block table inside the
  kernel, dequantize in the kernel and run an online softmax in float32; decode splits the context
  over several programs (flash decoding) and merges them with a small combine step.

Every head dim the profiles accept (up to 512) runs: tiles are padded and masked.  Planes of
>= 2**31 elements are addressed with 64-bit offsets (:mod:`pallas_kernels.triton.addressing`).
Out-of-range rows, table entries and positions under ``jit`` and non-finite K/V follow the rules
of :mod:`ninfer_kv.ops` and :mod:`ninfer_kv.ops.codecs`.

Layout
------
* ``pallas_kernels/common/``: what every kernel backend shares and nothing backend-specific: the
  codec tiles (one tile object per codec in ``CODEC_TILES``: encode, decode keys, decode values),
  tile math, the online softmax, the block-size configs, the head-dim limit and the cut of a ragged
  round into blocks.  It imports no Pallas module.
* ``pallas_kernels/triton/``: the Triton backend (``impl="pallas"``): its kernel bodies (masked
  gathers and scatters over whole operands), its Pallas surface, its compiler knobs and tile rules,
  its 64-bit addressing.
* ``pallas_kernels/mosaic_tpu/``: the Mosaic TPU backend (``impl="pallas_tpu"``): the paged ops and
  their ragged forms, pages moved by DMA into VMEM (its own package docstring).

A backend is chosen in one place, the op registry: an ``impl=`` name maps to a backend's ops.  A
new backend (e.g. Mosaic GPU) is a side-by-side subpackage ``pallas_kernels/<backend>/`` holding its
ops (the signatures above), its kernel bodies (its own memory access and grid around
``common.codec_tiles`` and ``common.softmax``), its compiler knobs (a frozen dataclass for the
configs' ``compiler`` field) and its tile rule (a ``common.tiles.Lanes``), plus one registration,
beside the built-in ones in :mod:`ninfer_kv.ops.dispatch` (or in the caller's code), as the Mosaic
TPU backend is registered::

    register_backend("pallas_tpu", {
        "paged_append": "pallas_kernels.mosaic_tpu.paged_append:paged_append", ...})

and the name in ``AUTO_PREFERENCE[platform]`` of :mod:`ninfer_kv.ops.registry` for
``impl="auto"`` to pick it.  Nothing in ``common/`` or the other backends changes.
"""

from .common.config import CyclicAppendConfig, CyclicAttentionConfig, PagedAppendConfig, PagedAttentionConfig
from .common.limits import MAX_HEAD_DIM, check_head_dim
from .triton.config import TritonConfig
from .triton.cyclic import cyclic_append, cyclic_attention
from .triton.paged_append import paged_append
from .triton.paged_attention import paged_attention
from .triton.ragged import paged_append_ragged, paged_attention_ragged

__all__ = [
    "paged_append",
    "paged_attention",
    "paged_append_ragged",
    "paged_attention_ragged",
    "cyclic_append",
    "cyclic_attention",
    "PagedAppendConfig",
    "CyclicAppendConfig",
    "PagedAttentionConfig",
    "CyclicAttentionConfig",
    "TritonConfig",
    "check_head_dim",
    "MAX_HEAD_DIM",
]
