"""An independent numpy / ml_dtypes implementation of the closed KV codecs (the test oracle).

Written from the rules of docs/LAYOUT.md, "Codec rules" alone, with the obvious numpy tools (``np.rint``,
``ml_dtypes`` casts, per-group loops over reshaped arrays), so that it shares no code and no trick
with :mod:`ninfer_kv.ops.codecs`:

* BF16: ``code = bf16(x)``; every NaN input -> the canonical quiet NaN ``0x7FC0``.
* INT8-G64: ``s = bf16(amax / 127)``; ``code = int8(clip(rint(x / s), -127, 127))``.
* FP8-E4M3FN-row: ``s = bf16(amax / 448)``; ``code = e4m3fn(clip(x / s, -448, 448))``.
* NVFP4-G16: ``sb = e4m3fn(min(amax / 6, 448))`` (raw bits stored), ``s = float(sb)``;
  ``code = e2m1(clip(x / s, -6, 6))``, element 2j in the low nibble of byte j.
* Odd values (ninfer_kv.ops.codecs): the quantizers (not BF16) read subnormal float32 inputs as zero
  of the same sign and flush a subnormal ``amax / q`` quotient to +0; ``amax`` propagates NaN
  (``np.max`` does), a NaN scale is stored as ``0x7FC0`` (bf16) or ``0x7F`` (NVFP4 byte); a scale
  that is zero or not finite stores codes 0.
* Dequantize: ``float(code) * s``.

All arithmetic is float32, as the rules require.  Every function takes ``(..., D)`` and returns
numpy arrays with the plane dtypes of :class:`ninfer_kv.schema.profiles.KVCodec`.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, Mapping

import ml_dtypes
import numpy as np

from ninfer_kv.schema.profiles import KVCodec, KVProfile

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
F32 = np.float32


def profile_codecs(profile) -> tuple[str, str]:
    """The codec names of K and V of a profile (a name or a ``KVProfile``), read from the spec table."""
    p = KVProfile.parse(profile)
    return p.k_codec.value, p.v_codec.value


def _groups(x: np.ndarray, size: int) -> np.ndarray:
    """(..., D) -> (..., D // size, size)."""
    return x.reshape(x.shape[:-1] + (x.shape[-1] // size, size))


TINY = np.finfo(F32).tiny


def _flush(x: np.ndarray) -> np.ndarray:
    """Subnormal float32 values -> zero of the same sign."""
    x = np.asarray(x, F32)
    return np.where(np.abs(x) < TINY, np.copysign(F32(0), x), x).astype(F32)


def _scale_bf16(amax: np.ndarray, q: float) -> np.ndarray:
    """bf16(amax / q) with a subnormal quotient flushed and NaN stored as 0x7FC0."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = _flush((amax / F32(q)).astype(F32)).astype(BF16)
    bits = np.where(np.isnan(amax), np.uint16(0x7FC0), s.view(np.uint16)).astype(np.uint16)
    return bits.view(BF16)


def _usable(s: np.ndarray) -> np.ndarray:
    """(..., G, 1): the scale is finite and nonzero."""
    return (np.isfinite(s) & (s != 0))[..., None]


def _divide_or_zero(x_groups: np.ndarray, s: np.ndarray) -> np.ndarray:
    """x / s per group (s broadcast over the last axis); groups whose s is 0 or not finite give 0."""
    ok = _usable(s)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        y = (x_groups / np.where(ok, s[..., None], F32(1))).astype(F32)
    return np.where(ok, y, F32(0))


# -- the codecs, one encoder and one decoder each ----------------------------------------------------


def _encode_bf16(x: np.ndarray) -> tuple[np.ndarray, None]:
    code = x.astype(BF16).view(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), code).astype(np.uint16).view(BF16), None


def _encode_int8_g64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = _flush(x)
    g = _groups(x, 64)
    s = _scale_bf16(np.max(np.abs(g), axis=-1), 127)
    y = _divide_or_zero(g, s.astype(F32))
    q = np.clip(np.rint(y), -127, 127).astype(np.int8)
    return q.reshape(x.shape), s


def _encode_fp8_row(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = _flush(x)
    g = _groups(x, x.shape[-1])
    s = _scale_bf16(np.max(np.abs(g), axis=-1), 448)
    y = _divide_or_zero(g, s.astype(F32))
    q = np.clip(y, F32(-448), F32(448)).astype(E4M3)
    q = np.where(_usable(s.astype(F32)), q, np.zeros((), E4M3))
    return q.reshape(x.shape), s


def _encode_nvfp4_g16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = _flush(x)
    g = _groups(x, 16)
    amax = np.max(np.abs(g), axis=-1)
    with np.errstate(invalid="ignore"):
        sb = np.minimum(_flush((amax / F32(6)).astype(F32)), F32(448)).astype(E4M3)
    sb_bits = np.where(np.isnan(amax), np.uint8(0x7F), sb.view(np.uint8)).astype(np.uint8)
    s = sb_bits.view(E4M3).astype(F32)
    y = _divide_or_zero(g, s)
    nib = np.clip(y, F32(-6), F32(6)).astype(E2M1).view(np.uint8) & 0xF
    nib = np.where(_usable(s), nib, np.uint8(0)).reshape(x.shape).astype(np.uint8)
    packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
    return packed, sb_bits


def _decode_bf16(code: np.ndarray, scale) -> np.ndarray:
    return code.astype(F32)


def _decode_int8_g64(code: np.ndarray, scale) -> np.ndarray:
    s = np.asarray(scale).astype(F32)
    g = _groups(code.astype(F32), 64) * s[..., None]
    return g.reshape(code.shape).astype(F32)


def _decode_fp8_row(code: np.ndarray, scale) -> np.ndarray:
    s = np.asarray(scale).astype(F32)
    return (code.astype(F32) * s).astype(F32)


def _decode_nvfp4_g16(code: np.ndarray, scale) -> np.ndarray:
    packed = code.astype(np.uint8)
    nib = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    nib[..., 0::2] = packed & 0xF
    nib[..., 1::2] = packed >> 4
    vals = nib.view(E2M1).astype(F32)
    s = np.asarray(scale).astype(np.uint8).view(E4M3).astype(F32)
    return (_groups(vals, 16) * s[..., None]).reshape(vals.shape).astype(F32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OracleCodec:
    """The oracle of one codec: ``encode(x float32 (..., D)) -> (codes, scales or None)`` and
    ``decode(codes, scales or None) -> float32 (..., D)``."""

    encode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]
    decode: Callable[[np.ndarray, np.ndarray | None], np.ndarray]


ORACLE_CODECS: Mapping[str, OracleCodec] = types.MappingProxyType({
    "bf16": OracleCodec(encode=_encode_bf16, decode=_decode_bf16),
    "int8-g64": OracleCodec(encode=_encode_int8_g64, decode=_decode_int8_g64),
    "fp8-e4m3fn-row": OracleCodec(encode=_encode_fp8_row, decode=_decode_fp8_row),
    "nvfp4-g16": OracleCodec(encode=_encode_nvfp4_g16, decode=_decode_nvfp4_g16),
})
"""The oracle's codecs by name (the :class:`~ninfer_kv.schema.profiles.KVCodec` values): one row per codec."""

if list(ORACLE_CODECS) != [c.value for c in KVCodec]:  # checked at import: one row per codec, in KVCodec's order
    raise RuntimeError(f"ORACLE_CODECS must have one row per KVCodec, in its order; rows {list(ORACLE_CODECS)}")


def _oracle(codec: str) -> OracleCodec:
    row = ORACLE_CODECS.get(codec)
    if row is None:
        raise ValueError(f"unknown codec {codec!r}")
    return row


def encode(codec: str, x) -> tuple[np.ndarray, np.ndarray | None]:
    """Quantize ``x (..., D)`` -> (codes, scales or None) with the plane dtypes of ``codec``."""
    return _oracle(codec).encode(np.asarray(x).astype(F32))


def decode(codec: str, code, scale) -> np.ndarray:
    """Dequantize codes (+ scales) of ``codec`` to float32 ``(..., D)``."""
    return _oracle(codec).decode(np.asarray(code), scale)


def encode_kv(profile, k, v) -> dict[str, np.ndarray]:
    """Plane values keyed ``k``, [``k_scale``], ``v``, [``v_scale``] for a profile (name or member)."""
    kc, vc = profile_codecs(profile)
    out = {}
    for name, codec, x in (("k", kc, k), ("v", vc, v)):
        code, scale = encode(codec, x)
        out[name] = code
        if scale is not None:
            out[f"{name}_scale"] = scale
    return out


def decode_kv(profile, planes: dict) -> tuple[np.ndarray, np.ndarray]:
    """float32 K and V ``(..., D)`` of plane values keyed as :func:`encode_kv` returns them."""
    kc, vc = profile_codecs(profile)
    return (
        decode(kc, planes["k"], planes.get("k_scale")),
        decode(vc, planes["v"], planes.get("v_scale")),
    )


def attention(q, k, v, visible, sm_scale: float, soft_cap=None, sinks=None) -> np.ndarray:
    """float64 masked GQA attention, one (row, query, head) at a time.

    q ``(B, T, Hq, D)``; k, v ``(B, J, H, D)``; visible bool ``(B, T, J)``. Query head ``hq`` reads
    KV head ``hq // (Hq // H)``; a query with no visible key yields zeros.  ``soft_cap``: scores
    become ``cap * tanh(s / cap)``; ``sinks (Hq,)``: ``exp(sink)`` joins each head's denominator.
    """
    q = np.asarray(q).astype(np.float64)
    k = np.asarray(k).astype(np.float64)
    v = np.asarray(v).astype(np.float64)
    b_, t_, hq_, d_ = q.shape
    group = hq_ // k.shape[2]
    out = np.zeros((b_, t_, hq_, d_), np.float64)
    for b in range(b_):
        for t in range(t_):
            idx = np.nonzero(visible[b, t])[0]
            if idx.size == 0:
                continue
            for hq in range(hq_):
                h = hq // group
                scores = sm_scale * (k[b, idx, h, :] @ q[b, t, hq, :])
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                top = scores.max() if sinks is None else max(scores.max(), float(sinks[hq]))
                p = np.exp(scores - top)
                denom = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[hq]) - top))
                out[b, t, hq] = (p / denom) @ v[b, idx, h, :]
    return out
