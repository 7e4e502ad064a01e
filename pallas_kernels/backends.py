"""Kernel backends: the one place that knows how a Pallas kernel is compiled for a GPU.

The seam
--------
Each op (paged append, paged attention, cyclic append, cyclic attention) is implemented per
backend by a function with one fixed signature, registered in :data:`IMPLEMENTATIONS` under
``(op, backend)``.  The public functions in :mod:`pallas_kernels` validate nothing beyond the
kernel's own limits, resolve the config and call the implementation named by
``config.backend``.  The backend-independent parts (address arithmetic, codec tile maths, the
flash-decoding combine, configs) live in the op modules and are shared.

Today there is one backend, ``"triton"`` (:data:`TRITON`): kernels written against the Pallas
Triton dialect (``jax.experimental.pallas.triton`` masked ``load``/``store``), compiled with
``jax.experimental.pallas.triton.CompilerParams(num_warps, num_stages)``.  Its ``pallas_call``
wrapper is the only place that builds compiler parameters or calls ``pl.pallas_call``; it also
makes the lowering address every operand of >= 2**31 elements with 64-bit offsets
(:mod:`pallas_kernels.addressing`).

A Mosaic GPU (Hopper, warpgroup/TMA) variant of an op is added beside it: write the kernel
against ``jax.experimental.pallas.mosaic_gpu``, give it a backend object with its own
``pallas_call`` (``plgpu.CompilerParams`` of Mosaic GPU, ``plgpu.kernel`` ...), register the op
implementation with :func:`register` under ``(op, "mosaic_gpu")``, and select it with
``config=...Config(backend="mosaic_gpu")``.  Callers and tests of the op do not change.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
from jax.experimental import pallas as pl

from .addressing import install_wide_offsets

__all__ = ["TritonBackend", "TRITON", "BACKENDS", "IMPLEMENTATIONS", "register", "implementation", "resolve_interpret"]


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: run the Pallas interpreter iff the default JAX backend is the CPU."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret={interpret!r} is invalid; it must be True, False or None")
    return interpret


@dataclasses.dataclass(frozen=True)
class TritonBackend:
    """Pallas on NVIDIA GPUs through the Triton lowering (runs in interpret mode on a CPU)."""

    name: str = "triton"

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
        from jax.experimental.pallas import triton as pl_triton

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
BACKENDS: dict[str, object] = {TRITON.name: TRITON}
IMPLEMENTATIONS: dict[tuple[str, str], Callable] = {}
_OPS = ("paged_append", "paged_attention", "cyclic_append", "cyclic_attention")


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` as the implementation of ``op`` on ``backend``."""
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; allowed: {', '.join(_OPS)}")

    def deco(fn: Callable) -> Callable:
        IMPLEMENTATIONS[(op, backend)] = fn
        return fn

    return deco


def implementation(op: str, backend: str) -> Callable:
    """The registered implementation of ``op`` on ``backend`` (``ValueError`` if there is none)."""
    try:
        return IMPLEMENTATIONS[(op, backend)]
    except KeyError:
        have = sorted(b for (o, b) in IMPLEMENTATIONS if o == op)
        raise ValueError(f"no {backend!r} implementation of {op}; available backends: {', '.join(have)}") from None
