"""The Triton backend's Pallas surface: every Pallas operation the Triton kernels use goes through here.

* memory: masked gathers and scatters ``jax.experimental.pallas.triton.load`` / ``store`` of
  ``ref.at[indexer]`` views (pointer arithmetic over whole operands) and scalar reads ``ref[idx]``;
  the kernel bodies build *indexers* (tuples of int32 scalars and broadcastable int32 arrays, one
  per ref dimension: page lookups, ring slots, GQA rows) and masks (bool arrays broadcastable to
  the value's shape, ``None`` meaning all true);
* program ids: ``pl.program_id``;
* compilation: ``pl.pallas_call`` with whole-array operands (no BlockSpec: the kernels compute their
  own addresses) and Triton compiler parameters (:class:`~pallas_kernels.triton.config.TritonConfig`);
* addressing: 64-bit offsets for operands of >= 2**31 elements in our kernels and the refusal of
  planes the lowering could not address (:mod:`pallas_kernels.triton.addressing`).

The kernel bodies (:mod:`~pallas_kernels.triton.append`, :mod:`~pallas_kernels.triton.attention` and
the op modules) receive the :data:`TRITON` object and import no Pallas module themselves.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from ..common.config import op_config, resolve_interpret
from ..common.limits import check_head_dim
from . import addressing
from .config import TritonConfig, triton_config

__all__ = ["TritonBackend", "TRITON", "prepare"]


@dataclasses.dataclass(frozen=True)
class TritonBackend:
    """Pallas on NVIDIA GPUs through the Triton lowering (runs in interpret mode on a CPU)."""

    def program_id(self, axis: int) -> jax.Array:
        """The program's index along grid axis ``axis`` (an int32 scalar)."""
        return pl.program_id(axis)

    def load(self, ref, *, mask: jax.Array | None = None, other=None) -> jax.Array:
        """Masked gather: the elements of ``ref`` where ``mask``; ``other`` elsewhere (unspecified when ``None``).

        A masked-off element is never read, so its address may be anything the indexer names.
        """
        return pl_triton.load(ref, mask=mask, other=other)

    def store(self, ref, value: jax.Array, *, mask: jax.Array | None = None) -> None:
        """Masked scatter: write ``value`` into ``ref`` where ``mask``; masked-off elements are not written."""
        pl_triton.store(ref, value, mask=mask)

    def load_scalar(self, ref, idx: tuple) -> jax.Array:
        """``ref[idx]`` for scalar indices (a table entry, a row's position or length)."""
        return ref[idx]

    def check_planes(self, planes: Mapping[str, jax.Array], *, interpret: bool) -> None:
        """Refuse planes the lowering would address with wrapping 32-bit offsets (see :mod:`pallas_kernels.triton.addressing`)."""
        addressing.check_plane_addressing(planes, interpret=interpret)

    def pallas_call(
        self,
        kernel: Callable,
        *,
        grid: tuple[int, ...],
        out_shape,
        compiler: TritonConfig,
        interpret: bool,
        name: str,
        input_output_aliases: dict[int, int] | None = None,
    ) -> Callable:
        """``pl.pallas_call`` running ``kernel`` over ``grid``, every operand and result passed whole.

        ``compiler`` is the resolved :class:`TritonConfig` (warps, stages); ``interpret`` runs the
        Pallas interpreter.
        """
        return pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=out_shape,
            input_output_aliases=input_output_aliases or {},
            interpret=interpret,
            compiler_params=addressing.compiler_params(compiler.num_warps, compiler.num_stages, interpret=interpret),
            name=re.sub(r"[^0-9A-Za-z_]", "_", name),
        )


TRITON = TritonBackend()
"""The backend object the Triton kernels run on."""


def prepare(config, config_type: type, view, interpret) -> tuple:
    """The public ops' prologue: ``(config, TritonConfig, interpret)`` resolved (``config`` ``None``:
    a default ``config_type()``; its ``compiler`` a :class:`TritonConfig` or ``None``), the head dim
    and the planes' addressing checked."""
    config = op_config(config, config_type)
    compiler = triton_config(config)
    check_head_dim(view.layout.profile, view.layout.head_dim)
    interpret = resolve_interpret(interpret)
    TRITON.check_planes(view.planes, interpret=interpret)
    return config, compiler, interpret
