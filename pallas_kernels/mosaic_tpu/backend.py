"""What the Mosaic TPU kernels share: interpret-mode resolution, compiler knobs, the tile rule,
VMEM lane reads and plane addressing.

:class:`MosaicConfig` is what the ``compiler`` field of :class:`~pallas_kernels.common.config.PagedAppendConfig`
and :class:`~pallas_kernels.common.config.PagedAttentionConfig` holds for these kernels.  The tile
rule (:func:`lanes`) pads nothing: every tile is a slice of a VMEM buffer whose last dim is the
whole lane extent of its plane or input (``X`` or ``D``), so Mosaic's own (8, 128) layout padding
of VMEM applies and no lane needs a mask.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ninfer_kv.schema.geometry import PlaneOrder

from ..common.config import check_int, op_config
from ..common.limits import check_head_dim
from ..common.tiles import Cols, Lanes, spread

__all__ = ["MosaicConfig", "mosaic_config", "lanes", "resolve_interpret", "read_cols", "page_tile", "check_order", "prepare"]


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Mosaic TPU compiler knobs of one kernel (the ``compiler`` field of an op config).

    Attributes:
      vmem_limit_bytes: scoped VMEM limit passed to Mosaic (``None``: Mosaic's default).
    """

    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        check_int("MosaicConfig", "vmem_limit_bytes", self.vmem_limit_bytes, 1 << 12, 1 << 30, pow2=False,
                  allow_none=True)

    def params(self, semantics: tuple) -> pltpu.CompilerParams:
        """The ``compiler_params`` of a ``pallas_call`` with grid ``semantics``."""
        return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=self.vmem_limit_bytes)


def mosaic_config(config) -> MosaicConfig:
    """The :class:`MosaicConfig` of an op config; ``TypeError`` when ``compiler`` holds another backend's knobs."""
    compiler = config.compiler
    if compiler is None:
        return MosaicConfig()
    if not isinstance(compiler, MosaicConfig):
        raise TypeError(f"{type(config).__name__}.compiler must be a MosaicConfig or None for the Mosaic TPU "
                        f"kernels, got {type(compiler).__name__}")
    return compiler


def lanes(head_dim: int) -> Lanes:
    """The TPU tile rule: tiles are exactly as wide as their real lanes (VMEM pads to 128 lanes itself)."""
    return Lanes(head_dim, lambda n: n, 1)


def resolve_interpret(interpret):
    """``None``: TPU interpret mode (``pltpu.InterpretParams()``) unless the default backend is a TPU.

    ``True`` is ``pltpu.InterpretParams()``, ``False`` compiles with Mosaic, and an
    ``InterpretParams`` (e.g. ``detect_races=True``) is passed through.
    """
    if interpret is None:
        return False if jax.default_backend() == "tpu" else pltpu.InterpretParams()
    if interpret is True:
        return pltpu.InterpretParams()
    if interpret is False or isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise ValueError(f"interpret={interpret!r} is invalid; it must be True, False, None or a pltpu.InterpretParams")


def check_order(order: PlaneOrder) -> None:
    """Both plane orders are supported; anything else is a ``ValueError`` naming them."""
    if order not in (PlaneOrder.PAGE_MAJOR, PlaneOrder.HEAD_MAJOR):
        raise ValueError(f"plane order {order!r} is not supported by the Mosaic TPU kernels; "
                         f"supported: page-major (L, N, H, 64, X) and head-major (L, H, N, 64, X)")


def page_tile(plane_ref, order: PlaneOrder, layer, page, head):
    """The ``(64, X)`` tile of (layer, page, head) of a stacked plane ref (a view for a DMA)."""
    if order is PlaneOrder.PAGE_MAJOR:
        return plane_ref.at[layer, page, head]
    return plane_ref.at[layer, head, page]


def read_cols(ref, cols: Cols) -> jax.Array:
    """The ``(rows, cols.n)`` tile of lanes ``cols`` of a 2-D VMEM ref.

    Contiguous and strided lanes are (strided) ref loads; lanes repeating a group value
    (``div > 1``, e.g. NVFP4 scales spread over their bytes) read each group's lane once and
    spread it with a select chain (no gather, no reshape).
    """
    if cols.real != cols.n:
        raise ValueError("the Mosaic TPU tile rule pads no lanes")
    if cols.div == 1:
        idx = pl.ds(cols.start, cols.n, stride=cols.stride) if cols.stride > 1 else pl.ds(cols.start, cols.n)
        return ref[:, idx]
    if cols.stride != 1 or cols.start % cols.div:
        raise ValueError(f"lanes {cols} are not a whole number of groups")
    g0, groups = cols.start // cols.div, -(-cols.n // cols.div)
    src = ref[:, pl.ds(g0, groups)]
    return spread([src[:, g] for g in range(groups)], cols.div, cols.n, src.dtype)


def prepare(config, config_type: type, view, interpret):
    """The public ops' prologue: ``(config, MosaicConfig, interpret)`` resolved, head dim and order checked."""
    config = op_config(config, config_type)
    compiler = mosaic_config(config)
    check_head_dim(view.layout.profile, view.layout.head_dim)
    check_order(view.layout.order)
    return config, compiler, resolve_interpret(interpret)
