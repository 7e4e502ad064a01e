"""Pallas GPU kernels (Triton backend) for ninfer_kv's paged and cyclic append and attention ops.

The four ops take exactly the arguments of the reference implementations in
:mod:`ninfer_kv.ops.reference`, plus keyword-only ``config`` (a frozen block-size dataclass; ``None``
picks defaults from the shapes) and ``interpret`` (``None``: run the Pallas interpreter iff the
default JAX backend is the CPU).  Inputs are assumed validated by :mod:`ninfer_kv.ops`.

* :func:`paged_append` / :func:`cyclic_append` quantize in the kernel and write in place (the planes
  are aliased input -> output; donate them in the calling ``jax.jit``).
* :func:`paged_attention` / :func:`cyclic_attention` read pages through the block table inside the
  kernel, dequantize in the kernel and run an online softmax in float32; decode splits the context
  over several programs (flash decoding) and merges them with a small combine step.

Every head dim the profiles accept (up to 512) runs: tiles are padded to a power of two and
masked.  Planes of >= 2**31 elements are addressed with 64-bit offsets
(:mod:`pallas_kernels.addressing`).  Out-of-range rows, table entries and positions under ``jit``
and non-finite K/V follow the rules of :mod:`ninfer_kv.ops` and :mod:`ninfer_kv.codecs`.

Kernel backends sit behind :mod:`pallas_kernels.backends` (today: Triton).
"""

from .backends import BACKENDS, IMPLEMENTATIONS, TRITON, TritonBackend, register
from .config import (
    CyclicAppendConfig,
    CyclicAttentionConfig,
    PagedAppendConfig,
    PagedAttentionConfig,
    ResolvedAttention,
)
from .cyclic import cyclic_append, cyclic_attention
from .limits import MAX_HEAD_DIM, check_head_dim
from .paged_append import paged_append
from .paged_attention import paged_attention

__all__ = [
    "paged_append",
    "paged_attention",
    "cyclic_append",
    "cyclic_attention",
    "PagedAppendConfig",
    "CyclicAppendConfig",
    "PagedAttentionConfig",
    "CyclicAttentionConfig",
    "ResolvedAttention",
    "BACKENDS",
    "IMPLEMENTATIONS",
    "TRITON",
    "TritonBackend",
    "register",
    "check_head_dim",
    "MAX_HEAD_DIM",
]
