"""Closed KV profiles: the persistent codec of each growing pool.

A profile resolves, for a head dim ``D``, into a *plane schema*: the typed K/V data and scale planes
of one (token, head), each with its dtype, leading extent ``X`` and quantization group.  Every byte
count in the package (page bytes, capacity curves, Host extents, memory summaries) is derived from
this schema, never from ``2 * vector_bytes``.

Five profiles are closed; there is no runtime bit-width combination:

============================  =============================  ==============================
profile (CLI name)            K planes                       V planes
============================  =============================  ==============================
BF16 (``bf16``)               k: bf16 X=D                    v: bf16 X=D
INT8_G64 (``int8-g64``)       k: int8 X=D, k_scale: bf16 D/64  v: int8 X=D, v_scale: bf16 D/64
FP8_E4M3FN_ROW256             k: e4m3fn X=D, k_scale: bf16 1   v: e4m3fn X=D, v_scale: bf16 1
NVFP4_G16 (``nvfp4-g16``)     k: u8 X=D/2, k_scale: u8 D/16    v: u8 X=D/2, v_scale: u8 D/16
K8V4 (``k8v4``)               K as FP8-E4M3FN-row            V as NVFP4-G16
============================  =============================  ==============================

Names.  Wherever a profile is named (``KVProfile.parse``, ``KVProfile("int8")``, ``ModelKVConfig``,
layouts, views, codecs, the command line's ``--profile`` / ``--kv-cache-dtype``) the same names are
accepted, case ignored: the profile names above, the enum member names (``INT8_G64``) and the
vLLM-style ``--kv-cache-dtype`` short names of :data:`PROFILE_ALIASES` (``fp8``, ``int8``,
``nvfp4``, ...).  The canonical profile is what gets stored and printed.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Mapping

import ml_dtypes
import numpy as np

__all__ = ["KVCodec", "CodecSpec", "CODEC_SPECS", "KVProfile", "PlaneSpec", "PROFILE_ALIASES", "profile_names", "SUPPORTED_HEAD_DIMS_NOTE"]

class KVCodec(enum.Enum):
    """The codec of one tensor (K or V) of a profile; every fact about it is its row of
    :data:`CODEC_SPECS`."""

    BF16 = "bf16"
    INT8_G64 = "int8-g64"
    FP8_E4M3FN_ROW = "fp8-e4m3fn-row"
    NVFP4_G16 = "nvfp4-g16"

    @property
    def spec(self) -> "CodecSpec":
        """This codec's row of :data:`CODEC_SPECS`."""
        return CODEC_SPECS[self]

    @property
    def code_dtype(self) -> np.dtype:
        """Storage dtype of the codes: bfloat16, int8, float8_e4m3fn or uint8 (two e2m1 nibbles a byte)."""
        return self.spec.code_dtype

    @property
    def scale_dtype(self) -> np.dtype | None:
        """Storage dtype of the scales: bfloat16 (INT8-G64, FP8 row), uint8 e4m3fn bits (NVFP4-G16), None (BF16)."""
        return self.spec.scale_dtype

    @property
    def has_scale(self) -> bool:
        """Whether the codec stores a scale plane (every codec but BF16)."""
        return self.scale_dtype is not None

    @property
    def pack(self) -> int:
        """Logical elements stored per code element (2 for packed e2m1 nibbles)."""
        return self.spec.pack

    def group_size(self, head_dim: int) -> int:
        """Elements along D that share one scale (1 for BF16: no scale; ``D`` for a row scale)."""
        group = self.spec.group
        return head_dim if group is None else group

    def check_head_dim(self, head_dim: int, profile_name: str | None = None) -> None:
        """Check that this codec can store vectors of ``head_dim`` elements.

        Args:
          head_dim: the head dim ``D``; a positive integer, a multiple of the codec's
            ``head_dim_multiple`` (64 for INT8-G64, 16 for NVFP4-G16; BF16 and FP8 row take any ``D``).
          profile_name: the name the error message gives (default the codec's own name).

        Raises:
          ValueError: naming the profile and ``head_dim`` when it is not supported.
        """
        name = profile_name or self.value
        if not isinstance(head_dim, (int, np.integer)) or isinstance(head_dim, bool) or head_dim <= 0:
            raise ValueError(f"profile {name}: head_dim={head_dim!r} is invalid; {SUPPORTED_HEAD_DIMS_NOTE}")
        multiple = self.spec.head_dim_multiple
        if head_dim % multiple:
            examples = ", ".join(str(multiple * i) for i in range(1, 5))
            raise ValueError(
                f"profile {name}: head_dim={head_dim} is not supported; {self.spec.label} needs head_dim % "
                f"{multiple} == 0 ({examples}, ...)"
            )

    def planes(self, tensor: str, head_dim: int) -> tuple["PlaneSpec", ...]:
        """The data plane and, when the codec has one, the scale plane of ``tensor`` ("k" or "v")."""
        self.check_head_dim(head_dim)
        group = self.group_size(head_dim)
        out = [
            PlaneSpec(
                name=tensor,
                tensor=tensor,
                role="data",
                codec=self,
                dtype=self.code_dtype,
                extent=head_dim // self.pack,
                group=group,
            )
        ]
        if self.has_scale:
            out.append(
                PlaneSpec(
                    name=f"{tensor}_scale",
                    tensor=tensor,
                    role="scale",
                    codec=self,
                    dtype=self.scale_dtype,
                    extent=head_dim // group,
                    group=group,
                )
            )
        return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecSpec:
    """One codec's row of the spec table: everything that differs between codecs, in one place.

    Rows are built with keywords.  The codec's float32 reference functions (JAX) are its row of
    :data:`ninfer_kv.ops.codecs.CODEC_REFERENCES`; this module stays free of JAX.

    Attributes:
      codec: the :class:`KVCodec`.
      label: its name in messages (``"INT8-G64"``).
      code_dtype: storage dtype of the codes; ``scale_dtype``: of the scales (``None``: no scale).
      pack: logical elements per stored code element (2 for packed e2m1 nibbles).
      group: elements along D sharing one scale (``None``: the whole row of D; 1 without a scale).
      head_dim_multiple: ``D`` must be a multiple of it.
      ffi_id: the codec's number in the C++ FFI kernels (its row of ``NINFER_KV_CODECS`` in
        ``ffi/src/common.h``).
      dense_tolerance: the largest absolute logit difference a model served through this codec may
        show against the unpaged full-precision model (the demo's check; a profile takes its codecs'
        largest).
    """

    codec: KVCodec
    label: str
    code_dtype: np.dtype
    scale_dtype: np.dtype | None
    pack: int
    group: int | None
    head_dim_multiple: int
    ffi_id: int
    dense_tolerance: float


_BF16, _E4M3 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)

CODEC_SPECS: Mapping[KVCodec, CodecSpec] = types.MappingProxyType({
    KVCodec.BF16: CodecSpec(
        codec=KVCodec.BF16, label="BF16", code_dtype=_BF16, scale_dtype=None, pack=1, group=1,
        head_dim_multiple=1, ffi_id=0, dense_tolerance=1e-3,
    ),
    KVCodec.INT8_G64: CodecSpec(
        codec=KVCodec.INT8_G64, label="INT8-G64", code_dtype=np.dtype(np.int8), scale_dtype=_BF16, pack=1, group=64,
        head_dim_multiple=64, ffi_id=1, dense_tolerance=3e-3,
    ),
    KVCodec.FP8_E4M3FN_ROW: CodecSpec(
        codec=KVCodec.FP8_E4M3FN_ROW, label="FP8-E4M3FN-row", code_dtype=_E4M3, scale_dtype=_BF16, pack=1, group=None,
        head_dim_multiple=1, ffi_id=2, dense_tolerance=3e-2,
    ),
    KVCodec.NVFP4_G16: CodecSpec(
        codec=KVCodec.NVFP4_G16, label="NVFP4-G16", code_dtype=np.dtype(np.uint8), scale_dtype=np.dtype(np.uint8),
        pack=2, group=16, head_dim_multiple=16, ffi_id=3, dense_tolerance=3e-2,
    ),
})
"""The codec spec table: one :class:`CodecSpec` per codec (read by profiles, planning, the codecs,
the FFI binding, the kernels' tests and the command line)."""


def _head_dim_rule() -> str:
    multiples = [(s.label, s.head_dim_multiple) for s in CODEC_SPECS.values() if s.head_dim_multiple > 1]
    return ", ".join(f"{label} {'needs ' if i == 0 else ''}a multiple of {m}" for i, (label, m) in enumerate(multiples))


SUPPORTED_HEAD_DIMS_NOTE = f"head_dim must be a positive integer; {_head_dim_rule()}"
"""What a head dim must be, from the spec table: "head_dim must be a positive integer; INT8-G64 needs a
multiple of 64, NVFP4-G16 a multiple of 16"."""


@dataclasses.dataclass(frozen=True)
class PlaneSpec:
    """One typed plane of the schema, for one (token, head).

    Attributes:
      name: plane key, one of ``k``, ``k_scale``, ``v``, ``v_scale``.
      tensor: ``k`` or ``v``.
      role: ``data`` (codes) or ``scale``.
      codec: the codec of ``tensor``.
      dtype: storage dtype of one element of the plane.
      extent: the leading extent ``X`` (elements per token-head).
      group: elements along D covered by one scale (1 for BF16).
    """

    name: str
    tensor: str
    role: str
    codec: KVCodec
    dtype: np.dtype
    extent: int
    group: int

    @property
    def token_head_bytes(self) -> int:
        """Bytes of this plane for one (token, KV head): ``extent * dtype.itemsize``."""
        return self.extent * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        """The storage dtype's numpy name (``"bfloat16"``, ``"int8"``, ``"float8_e4m3fn"``, ``"uint8"``)."""
        return self.dtype.name

    def to_json(self) -> dict:
        """``{"name", "dtype", "extent", "group", "bytes"}``, ``bytes`` being :attr:`token_head_bytes`."""
        return {
            "name": self.name,
            "dtype": self.dtype_name,
            "extent": self.extent,
            "group": self.group,
            "bytes": self.token_head_bytes,
        }


class KVProfile(enum.Enum):
    """The five closed KV profiles of Main Text and MTP pools (Draft Full is always BF16)."""

    BF16 = "bf16"
    INT8_G64 = "int8-g64"
    FP8_E4M3FN_ROW256 = "fp8-e4m3fn-row256"
    NVFP4_G16 = "nvfp4-g16"
    K8V4 = "k8v4"

    @classmethod
    def parse(cls, name: "str | KVProfile") -> "KVProfile":
        """Resolve a profile name, case ignored.

        Accepts a profile name (``bf16``, ``int8-g64``, ...), a short name of
        :data:`PROFILE_ALIASES` (``int8``, ``fp8``, ``nvfp4``, ...), an enum member name
        (``INT8_G64``) or a member itself.

        Raises:
          ValueError: naming the value and every accepted name and short name.
        """
        if isinstance(name, KVProfile):
            return name
        if isinstance(name, str):
            key = name.strip()
            alias = PROFILE_ALIASES.get(key.lower())
            if alias is not None:
                return alias
            for member in cls:
                if key.lower() == member.value or key.upper() == member.name:
                    return member
        raise ValueError(f"unknown KV profile {name!r}; allowed: {profile_names()}")

    @classmethod
    def _missing_(cls, value: object) -> "KVProfile":
        # ``KVProfile("int8")`` resolves like ``KVProfile.parse("int8")``.
        return cls.parse(value)

    @property
    def k_codec(self) -> KVCodec:
        """The codec of K (FP8-E4M3FN-row for K8V4)."""
        return {
            KVProfile.BF16: KVCodec.BF16,
            KVProfile.INT8_G64: KVCodec.INT8_G64,
            KVProfile.FP8_E4M3FN_ROW256: KVCodec.FP8_E4M3FN_ROW,
            KVProfile.NVFP4_G16: KVCodec.NVFP4_G16,
            KVProfile.K8V4: KVCodec.FP8_E4M3FN_ROW,
        }[self]

    @property
    def v_codec(self) -> KVCodec:
        """The codec of V (NVFP4-G16 for K8V4; otherwise the same as :attr:`k_codec`)."""
        return KVCodec.NVFP4_G16 if self is KVProfile.K8V4 else self.k_codec

    def codec(self, tensor: str) -> KVCodec:
        """The codec of ``tensor``: :attr:`k_codec` for ``"k"``, :attr:`v_codec` for ``"v"``.

        Raises:
          ValueError: ``tensor`` is neither ``"k"`` nor ``"v"``.
        """
        if tensor == "k":
            return self.k_codec
        if tensor == "v":
            return self.v_codec
        raise ValueError(f"tensor must be 'k' or 'v', got {tensor!r}")

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ``ValueError`` naming the profile and D when this profile cannot store ``head_dim``."""
        self.k_codec.check_head_dim(head_dim, self.value)
        self.v_codec.check_head_dim(head_dim, self.value)

    def planes(self, head_dim: int) -> tuple[PlaneSpec, ...]:
        """The plane schema in ordinal order: ``k``, [``k_scale``], ``v``, [``v_scale``]."""
        self.check_head_dim(head_dim)
        return self.k_codec.planes("k", head_dim) + self.v_codec.planes("v", head_dim)

    def plane_names(self) -> tuple[str, ...]:
        """The plane keys in schema order, without a head dim: ``k``, [``k_scale``], ``v``, [``v_scale``]."""
        names = ["k"] + (["k_scale"] if self.k_codec.has_scale else [])
        names += ["v"] + (["v_scale"] if self.v_codec.has_scale else [])
        return tuple(names)

    def tensor_bytes(self, tensor: str, head_dim: int) -> int:
        """Bytes of one (token, head) of K or V: code plus scale."""
        return sum(p.token_head_bytes for p in self.planes(head_dim) if p.tensor == tensor)

    def token_head_bytes(self, head_dim: int) -> int:
        """Bytes of one (token, head) of K and V together."""
        return sum(p.token_head_bytes for p in self.planes(head_dim))


PROFILE_ALIASES: Mapping[str, KVProfile] = types.MappingProxyType(
    {
        "bfloat16": KVProfile.BF16,
        "fp8": KVProfile.FP8_E4M3FN_ROW256,
        "fp8_e4m3": KVProfile.FP8_E4M3FN_ROW256,
        "int8": KVProfile.INT8_G64,
        "nvfp4": KVProfile.NVFP4_G16,
    }
)
"""Short names (vLLM-style ``--kv-cache-dtype`` values) and the closed profile each one selects.

``bf16`` and ``k8v4`` are profile names already.  The one table: :meth:`KVProfile.parse` and the
command line both resolve through it.
"""


def profile_names() -> str:
    """Every accepted name in words: the profile names, then the short names with their profiles."""
    names = ", ".join(m.value for m in KVProfile)
    short = ", ".join(f"{alias} ({profile.value})" for alias, profile in PROFILE_ALIASES.items())
    return f"{names}; short names: {short}"
