"""The Triton backend: Pallas on NVIDIA GPUs through the Triton lowering (interpret mode on a CPU).

Every Triton-only operation the kernels use is here (the :class:`pallas_kernels.backend.KernelBackend`
interface):

* memory: masked gathers and scatters ``jax.experimental.pallas.triton.load`` / ``store`` of
  ``ref.at[indexer]`` views (pointer arithmetic over whole operands) and scalar reads ``ref[idx]``;
* program ids: ``pl.program_id``;
* compilation: ``pl.pallas_call`` with whole-array operands (no BlockSpec: the kernels compute their
  own addresses) and ``jax.experimental.pallas.triton.CompilerParams(num_warps, num_stages)``;
* addressing: 64-bit offsets for operands of >= 2**31 elements and the refusal of planes the
  lowering could not address (:mod:`pallas_kernels.triton_addressing`).

Config ``backend="triton"`` (the default) selects it (:func:`pallas_kernels.backend.kernel_backend`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from .triton_addressing import check_plane_addressing, install_wide_offsets

__all__ = ["TritonBackend", "TRITON", "BACKEND"]


@dataclasses.dataclass(frozen=True)
class TritonBackend:
    """Pallas on NVIDIA GPUs through the Triton lowering (runs in interpret mode on a CPU)."""

    name: str = "triton"

    def program_id(self, axis: int) -> jax.Array:
        """``pl.program_id(axis)``."""
        return pl.program_id(axis)

    def load(self, ref, *, mask: jax.Array | None = None, other=None) -> jax.Array:
        """Masked gather ``pallas.triton.load(ref, mask=mask, other=other)``."""
        return pl_triton.load(ref, mask=mask, other=other)

    def store(self, ref, value: jax.Array, *, mask: jax.Array | None = None) -> None:
        """Masked scatter ``pallas.triton.store(ref, value, mask=mask)``."""
        pl_triton.store(ref, value, mask=mask)

    def load_scalar(self, ref, idx: tuple) -> jax.Array:
        """``ref[idx]`` (a scalar load through the operand's pointer)."""
        return ref[idx]

    def check_planes(self, planes: Mapping[str, jax.Array], *, interpret: bool) -> None:
        """Refuse planes the lowering would address with wrapping 32-bit offsets (see :mod:`pallas_kernels.triton_addressing`)."""
        check_plane_addressing(planes, interpret=interpret)

    def pallas_call(
        self,
        kernel: Callable,
        *,
        grid: tuple[int, ...],
        out_shape,
        num_warps: int,
        num_stages: int,
        interpret: bool,
        name: str,
        input_output_aliases: dict[int, int] | None = None,
    ) -> Callable:
        """``pl.pallas_call`` with whole-array operands (kernels index them explicitly).

        Every operand and result is passed whole: the kernels compute their own addresses (page
        lookups, ring slots, GQA rows) and use masked loads/stores, so no BlockSpec is needed.
        """
        if not interpret:
            install_wide_offsets()  # 64-bit offsets for every operand of >= 2**31 elements
        return pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=out_shape,
            input_output_aliases=input_output_aliases or {},
            interpret=interpret,
            compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            name=re.sub(r"[^0-9A-Za-z_]", "_", name),
        )


TRITON = TritonBackend()
BACKEND = TRITON
"""The object :func:`pallas_kernels.backend.kernel_backend` returns for ``"triton"``."""
