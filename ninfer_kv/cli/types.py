"""Argparse ``type=`` callables whose errors are one line naming the value and the allowed range.

:func:`arg_type` wraps a converter that raises ``ValueError`` so argparse reports the message
verbatim (``argument --head-dim: 0 is out of range; it must be an integer >= 1``).  The library's
own parsers do the work: byte sizes are :func:`ninfer_kv.schema.sizes.parse_bytes`, profiles
:meth:`ninfer_kv.schema.profiles.KVProfile.parse` (which accepts the short names of
:data:`ninfer_kv.schema.profiles.PROFILE_ALIASES`), so the command line and Python accept the same text.
"""

from __future__ import annotations

import argparse
from typing import Callable

from ..schema.integers import check_int, int_range
from ..schema.profiles import PROFILE_ALIASES, KVProfile, profile_names
from ..schema.sizes import parse_bytes

__all__ = [
    "arg_type",
    "bounded_int",
    "KV_CACHE_DTYPES",
    "PROFILE_HELP",
    "POSITIVE_INT",
    "NON_NEGATIVE_INT",
    "BYTES",
    "PROFILE",
    "ORDER",
    "SPECULATIVE",
    "MESH",
    "IMPL",
    "IMPL_HELP",
    "add_profile",
]

_MAX_DIGITS = 60


def arg_type(name: str, fn: Callable[[str], object]) -> Callable[[str], object]:
    """Wrap a converter so argparse reports its ``ValueError`` message verbatim."""

    def convert(text):
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def _out_of_range(_name: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"{value} is out of range; it must be {allowed}")


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=`` for text naming an integer in ``[minimum, maximum]`` (:func:`check_int`)."""
    allowed = int_range(minimum, maximum)

    def parse(text: str) -> int:
        digits = str(text).strip()
        if len(digits.lstrip("+-")) > _MAX_DIGITS and digits.lstrip("+-").isdigit():
            raise ValueError(f"{digits[:12]}... ({len(digits)} digits) is too large; it must be {allowed}")
        try:
            value = int(digits, 10)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer; it must be {allowed}") from None
        return check_int("", value, minimum, maximum, error=_out_of_range)

    return arg_type("int", parse)


def bounded_int(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse ``type=`` for integers in ``[minimum, maximum]`` (one-line errors naming the range)."""
    return _int_at_least(minimum, maximum)


KV_CACHE_DTYPES = PROFILE_ALIASES
"""The ``--kv-cache-dtype`` short names: the one table of :data:`ninfer_kv.schema.profiles.PROFILE_ALIASES`."""

PROFILE_HELP = f"KV profile: {profile_names()}"


def _order(text: str):
    from ..schema.geometry import PlaneOrder

    return PlaneOrder.parse(text)


def _speculative(text: str):
    from ..schema.kinds import SpeculativeMethod

    return SpeculativeMethod.parse(text)


def _impl(text: str) -> str:
    from ..ops.registry import impl_choices  # imported when an --impl is parsed: the registry loads JAX

    value = str(text).strip().lower()
    if value not in impl_choices():
        raise ValueError(f"impl {text!r} is not registered; allowed: {', '.join(impl_choices())}")
    return value


IMPL_HELP = ("op implementation: auto (the platform's preference: FFI on CPU, Pallas on GPU, Mosaic on TPU; "
             "default) or a registered one (reference, pallas, ffi, pallas_tpu, and any registered by the caller)")


def _mesh(text: str):
    from ..schema.mesh_spec import MeshSpec

    return MeshSpec.parse(text)


POSITIVE_INT = _int_at_least(1)
NON_NEGATIVE_INT = _int_at_least(0)
BYTES = arg_type("bytes", parse_bytes)
PROFILE = arg_type("profile", KVProfile.parse)
ORDER = arg_type("order", _order)
SPECULATIVE = arg_type("speculative method", _speculative)
MESH = arg_type("mesh", _mesh)
IMPL = arg_type("impl", _impl)


def add_profile(p) -> None:
    """Add the required ``--profile`` flag (alias ``--kv-cache-dtype``) to a parser or argument group."""
    p.add_argument("--profile", "--kv-cache-dtype", dest="profile", type=PROFILE, required=True, help=PROFILE_HELP)
