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
(:mod:`pallas_kernels.triton_addressing`).  Out-of-range rows, table entries and positions under
``jit`` and non-finite K/V follow the rules of :mod:`ninfer_kv.ops` and :mod:`ninfer_kv.codecs`.

Kernel backends
---------------
The kernel bodies are shared by every backend: :mod:`~pallas_kernels.attention_core`,
:mod:`~pallas_kernels.append_core`, the key sources and addressers of
:mod:`~pallas_kernels.paged_attention`, :mod:`~pallas_kernels.paged_append` and
:mod:`~pallas_kernels.cyclic`, and the codec tiles (:mod:`~pallas_kernels.codec_tiles`) use plain
``jax.numpy`` / ``jax.lax`` and a backend object for everything else: masked loads and stores,
scalar loads, program ids, the plane-addressing check and the ``pallas_call`` with its compiler
parameters (the interface :class:`~pallas_kernels.backend.KernelBackend`).  The ``backend`` field
of the configs (default ``"triton"``) names the backend; backend ``name`` is the ``BACKEND`` object
of the module ``pallas_kernels/<name>_backend.py`` (:func:`~pallas_kernels.backend.kernel_backend`).
Today there is one: ``"triton"`` (:mod:`pallas_kernels.triton_backend`, with its helper
:mod:`pallas_kernels.triton_addressing`); it is the ``"pallas"`` implementation of
:mod:`ninfer_kv.ops`.

A Mosaic GPU backend adds these files and nothing else changes:

* ``pallas_kernels/mosaic_gpu_backend.py``: a class implementing ``KernelBackend`` with
  ``jax.experimental.pallas.mosaic_gpu`` (its ``load`` / ``store`` / ``load_scalar``,
  ``program_id``, ``check_planes`` and a ``pallas_call`` building ``plgpu.CompilerParams``), the
  object ``BACKEND = MosaicGPUBackend()`` (name ``"mosaic_gpu"``), and its ops
  ``paged_append, paged_attention, cyclic_append, cyclic_attention = bound_ops("mosaic_gpu")``
  (:func:`pallas_kernels.bound.bound_ops`);
* optionally ``pallas_kernels/mosaic_gpu_*.py`` for helpers only it needs.

``config=PagedAttentionConfig(backend="mosaic_gpu")`` (any op's config) then runs the shared kernels
on it, and the one registration, a line beside the built-in ones in :mod:`ninfer_kv.ops.dispatch`
(or in the caller's code), makes it an ``impl=`` of :mod:`ninfer_kv.ops`::

    register_backend("pallas_mosaic_gpu", {op: f"pallas_kernels.mosaic_gpu_backend:{op}" for op in OP_NAMES})

(append the name to ``AUTO_PREFERENCE["gpu"]`` for ``impl="auto"`` to try it).  A TPU (Mosaic TPU)
backend is the same with ``pallas_kernels/tpu_backend.py``, ``bound_ops("tpu")`` and
``register_backend("pallas_tpu", {op: f"pallas_kernels.tpu_backend:{op}" for op in OP_NAMES})``
(``AUTO_PREFERENCE["tpu"]``).

The interface is at the level of masked gathers and scatters: the kernel bodies compute every
element's address (page lookups, ring slots, GQA rows) and hand ``ref.at[indexer]`` views to
``load`` / ``store``, as Triton's pointer arithmetic allows.  A backend whose memory operations
are block copies (Mosaic GPU's TMA, Mosaic TPU's DMAs) has to implement those views itself, and
it receives the configs' ``num_warps`` / ``num_stages`` as they are.
"""

from .backend import KernelBackend, kernel_backend, kernel_backend_names
from .bound import bound_ops
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
from .triton_backend import TRITON, TritonBackend

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
    "KernelBackend",
    "kernel_backend",
    "kernel_backend_names",
    "bound_ops",
    "TRITON",
    "TritonBackend",
    "check_head_dim",
    "MAX_HEAD_DIM",
]
