"""Runs the FFI ops once per profile at the instruction-set level this process loaded; saves .npz.

Started by ``test_ffi_levels.py`` in a subprocess per level (``NINFER_KV_FFI_ISA=<level>``)::

    python tests/ffi/level_probe.py OUT.npz

Every level gets the same inputs (fixed seed): float32 and bfloat16 appends whose groups hold NaN,
+-inf, zeros and subnormals (into zeroed pools), and attention over a pool filled by a clean
append.  The parent checks the saved planes against the codec rules and the other levels, and the
attention outputs against a float64 oracle.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_kv.ops.ffi import kv as ffi_kv  # noqa: E402
from ninfer_kv.ops.ffi import handlers as ffi_handlers  # noqa: E402
from ninfer_kv.schema.layout import PagedKVStorageLayout  # noqa: E402
from ninfer_kv.schema.profiles import KVProfile  # noqa: E402
from ninfer_kv.ops.views import PagedKVBatchLayerView  # noqa: E402
from ninfer_kv.ops.views import allocate_planes

PROFILES = tuple(p.value for p in KVProfile)  # every profile of the spec table
B, T, H, D, G = 2, 70, 2, 64, 4  # two pages per row; GQA 4
TABLE = np.array([[5, 1], [0, 3], [4, 2]], np.int32)  # C = 3 rows, L = 2 blocks, N = 6 pages
TABLE_ROWS = np.array([2, 0], np.int32)
POSITIONS = np.array([0, 0], np.int32)
VALID = np.array([70, 69], np.int32)
Q_POSITIONS = np.array([60, 30], np.int32)
KV_LENS = np.array([70, 31], np.int32)


def inputs() -> dict[str, np.ndarray]:
    """The fixed inputs of every level (also saved, so the parent checks against them)."""
    rng = np.random.default_rng(1234)
    k = rng.standard_normal((B, T, H, D)).astype(np.float32)
    v = rng.standard_normal((B, T, H, D)).astype(np.float32)
    odd_k, odd_v = k.copy(), v.copy()
    odd_k[0, 0, 0, 5] = np.nan  # a NaN in INT8 group 0 / the FP8 row / NVFP4 group 0
    odd_k[0, 1, 1, 20] = np.inf
    odd_k[0, 2, 0, 33] = -np.inf
    odd_k[0, 2, 0, 34] = np.nan  # NaN and inf in one group: NaN wins
    odd_v[1, 3, 0, 0] = np.uint32(0xFFC00001).view(np.float32)  # a negative NaN with a payload
    odd_v[1, 4, 1, :16] = 0.0
    odd_v[1, 4, 1, 16] = -0.0  # a zero group (NVFP4) with -0.0
    odd_v[0, 5, 0, :] = np.float32(1e-40)  # subnormal elements
    odd_k[1, 6, 1, :] = np.float32(3e-39) * np.arange(D, dtype=np.float32)  # normal amax, subnormal quotients
    odd_k[1, 7, 0, 40:] = -odd_k[1, 7, 0, 40:] * 1e4  # large values, finite
    bf_k = odd_k.astype(ml_dtypes.bfloat16)
    bf_v = odd_v.astype(ml_dtypes.bfloat16)
    bf_k.view(np.uint16)[1, 8, 0, 3] = 0xFFC1  # bfloat16 NaNs of other signs and payloads
    bf_v.view(np.uint16)[0, 9, 1, 7] = 0x7F81
    q = rng.standard_normal((B, 2, H * G, D)).astype(np.float32)
    return {"k": k, "v": v, "odd_k": odd_k, "odd_v": odd_v, "bf_k": bf_k, "bf_v": bf_v, "q": q}


_append_call = jax.jit(ffi_kv.paged_append)
_attention = jax.jit(ffi_kv.paged_attention)


def _append(lay, k, v) -> dict:
    planes = allocate_planes(lay, TABLE.max() + 1)
    view = PagedKVBatchLayerView(planes, jnp.asarray(TABLE), 0, lay)
    return _append_call(view, TABLE_ROWS, POSITIONS, jnp.asarray(k), jnp.asarray(v), VALID).planes


def main(path: str) -> None:
    x = inputs()
    saved = {"isa": np.array(ffi_handlers.info().isa)}
    saved.update({f"input_{name}": val for name, val in x.items() if name != "bf_k" and name != "bf_v"})
    saved["input_bf_k"] = x["bf_k"].view(np.uint16)
    saved["input_bf_v"] = x["bf_v"].view(np.uint16)
    for profile in PROFILES:
        lay = PagedKVStorageLayout(profile, 1, H, D, "page-major")
        runs = {"odd": (x["odd_k"], x["odd_v"]), "bf": (x["bf_k"], x["bf_v"]), "clean": (x["k"], x["v"])}
        for run, (k, v) in runs.items():
            planes = _append(lay, k, v)
            for name, plane in planes.items():
                saved[f"{profile}/{run}/{name}"] = np.asarray(plane).view(np.uint8)
        view = PagedKVBatchLayerView(planes, jnp.asarray(TABLE), 0, lay)  # the clean pool
        out = _attention(jnp.asarray(x["q"]), view, TABLE_ROWS, Q_POSITIONS, KV_LENS)
        saved[f"{profile}/attention"] = np.asarray(out)
        ar = ffi_handlers.arithmetic(profile, D)
        saved[f"{profile}/arithmetic"] = np.array([ar.scores, ar.values])
    np.savez(path, **saved)


if __name__ == "__main__":
    main(sys.argv[1])
