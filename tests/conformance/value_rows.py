"""K/V rows of odd values and rounding boundaries, for any head dim of at least 32.

:func:`odd_rows` holds NaN (both signs, payloads), +-inf, subnormals, +-0 and values near the
float32 limits; :func:`boundary_rows` puts every rounding tie of the codecs under a scale pinned
to 1 (a group maximum of 448, 127 or 6).  Together they reach every rule of the codec table in
docs/ACCURACY.md.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32


def odd_rows(d: int) -> np.ndarray:
    """(14, d) float32 rows: each one exercises NaN, inf, subnormal, zero, tie or range handling."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal((14, d)).astype(F32)
    r = base.copy()
    r[0, 3] = np.nan  # NaN in the first group
    r[1, 17 % d] = np.uint32(0xFFC00001).view(F32)  # a negative NaN with a payload, in NVFP4 group 1
    r[2, 5] = np.inf
    r[3, (d - 24) % d] = -np.inf
    r[4, 7], r[4, 9] = -np.inf, np.nan  # inf and NaN in one group: NaN wins
    r[5] = 0.0
    r[6] = -0.0
    r[7] = base[7] * F32(1e-39)  # every element subnormal
    r[8] = base[8] * F32(2e-38)  # normal amax, subnormal amax / 127 and amax / 448
    r[9, ::2] = F32(3e-40)  # subnormals beside normal values
    r[9, 1::4] = -F32(2e-41)
    r[10] = np.resize(np.arange(-31.5, 32.0, 1.0, dtype=F32), d)  # rint ties at scale 2**-2
    r[10, 0] = 31.75
    ties = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0], F32)
    r[11] = np.resize(ties, d)  # e2m1 ties under an NVFP4 scale of exactly 1
    r[12] = F32(3.4e38) * np.sign(base[12])  # near float32 max (bf16 scale rounding)
    r[13, :16] = F32(1.1754944e-38)  # a group of FLT_MIN
    return r


def boundary_rows(d: int) -> np.ndarray:
    """(R, d) float32 rows hitting every rounding tie of the codecs, each group's scale pinned to 1."""
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)
    e4m3 = np.unique(e4m3[np.isfinite(e4m3) & (e4m3 >= 0)])
    e4m3_mid = (e4m3[:-1] + e4m3[1:]) / 2  # ties in the subnormal and normal ranges
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)
    e2m1_mid = (e2m1[:-1] + e2m1[1:]) / 2
    int8_mid = np.arange(-127, 127, dtype=F32) + F32(0.5)
    bf16_mid = F32(1.0) + F32(2.0**-8) * np.arange(1, 64, 2, dtype=F32)

    def row(values, amax, group):
        """``values`` resized to d, with the last element of every group set to ``amax``."""
        r = np.resize(np.asarray(values, F32), d).copy()
        r[group - 1 :: group] = amax
        return r

    rows = []
    # amax 448 -> FP8 row scale 1; amax 6 -> NVFP4 group scale 1; amax 127 -> INT8 group scale 1
    for chunk in np.array_split(e4m3_mid, -(-e4m3_mid.size // (d // 2 - 1))):  # each chunk and its negation fit
        rows.append(row(np.concatenate([chunk, -chunk]), 448.0, d))
    rows.append(row(np.concatenate([e2m1_mid, -e2m1_mid, e2m1, -e2m1]), 6.0, 16))
    for chunk in np.array_split(int8_mid, max(1, int8_mid.size // 63)):
        rows.append(row(chunk, 127.0, 64))
    rows.append(row(bf16_mid, 2.0, d))
    tiny = np.full(d, 3e-38, F32)
    tiny[::3] *= -1
    rows.append(tiny)  # scales that underflow
    big = np.full(d, 3e38, F32)
    big[1::2] = -1e-3
    rows.append(big)
    return np.stack(rows)


def value_rows(d: int) -> np.ndarray:
    """Odd rows then boundary rows."""
    return np.concatenate([odd_rows(d), boundary_rows(d)])
