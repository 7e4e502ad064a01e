"""GPU check of the Pallas kernels: correctness against the reference, then decode and append speed.

One run of a few minutes on a CUDA device; results print as they come, as markdown.  Every
section has its own time budget (``--budget SECTION=SECONDS``); a section stops starting new work
when its budget is spent, so one slow section cannot starve the next.  Sections, in order:

``setup``
    ``impl="auto"`` resolves to Pallas on the GPU (and an ``auto`` op call gives the bits of the
    direct kernel call); HBM bandwidth baselines: an elementwise copy (``x + 1``, read + write)
    and a read-only reduction (``sum(x)``).
``decode``
    Decode attention, B = 64 rows, H = 8 KV heads, Hq = 32, D = 128, contexts 32K first, then 8K;
    BF16 and K8V4, both plane orders, pages in random physical order, page content a hash of the
    page ID (an address bug reads wrong bytes); N back-to-back calls timed with one wait; the
    timed call's output checked against the float32 reference on rows holding high page IDs.
``peer``
    ``jax.experimental.pallas.ops.gpu.paged_attention`` on the same BF16 head-major data, swept
    over ``pages_per_compute_block`` {1, 2, 4} and ``k_splits``; every setting printed, the best
    reported next to ours, its output checked against ours.
``large``
    A K8V4 pool with H = 8, D = 128 and 40000 pages: its FP8 key plane is 2.44 GiB of 1-byte codes
    (2.6e9 elements: past 2**31, inside the range where the Triton lowering would use 32-bit
    offsets).  Rows read pages on both sides of element 2**31; an append writes tokens into pages
    past it (compared token by token), then decode attention is timed and checked.
``correctness``
    Small shapes, every profile and both plane orders: paged append with bfloat16 and float32 K/V
    (only the written tokens are compared with the CPU reference bits: codes within one code step
    as DESIGN allows, scales exact, every other byte identical to the plane before the append),
    decode with a context split and chunk attention with bfloat16 and float32 queries, GQA G = 8
    at D = 64 and D = 256, cyclic append and attention.
``append``
    Decode (B = 64, T = 1) and chunk (B = 8, T = 256) appends, bfloat16 and float32 K/V, planes
    donated: N back-to-back calls timed with one wait; the written tokens checked after the run;
    donation must keep the plane buffers (same device pointers before and after).
``ragged``
    Mixed rounds through ``ninfer_kv.ops.paged_append_ragged`` / ``paged_attention_ragged`` with
    ``impl="pallas"`` (:data:`RAGGED_ROUNDS`: 8 decodes at 4K beside one 1024-token prefill chunk;
    64 decodes at 2K), BF16 and K8V4, page-major (the engine's Main pool), pages in random physical
    order with hashed bytes, H = 8, Hq = 32, D = 128.  First the append (written tokens against the
    reference encoding, every other byte unchanged) and the attention (against the float32
    reference ragged op, ``impl="reference"``, on the first and last decode rows and the first,
    middle and last queries of every chunk), then the median time of single calls (after a
    warm-up, each waited for) against the HBM roofline: the bytes of each row's live pages read
    once per KV head per query block (:func:`ragged_ideal_bytes`, the kernel's ``block_q``).
``engine``
    A small random bf16 decoder (:data:`ENGINE_MODEL`) served by ``ninfer_kv.LLM`` with
    ``impl="pallas"``: a warm-up pass of the workload (compiles every shape), then a workload of
    the same shape timed (16 new prompts of 512 tokens, 256 greedy tokens each, ``ignore_eos``,
    prefix caching off); prints generated tokens/s, prompt tokens/s, the units run by kind and
    whether the rounds were ragged, which must be exactly when the model's ops have native ragged
    kernels (:attr:`~ninfer_kv.engine.model.DecoderModel.runs_ragged_natively`).

Attention outputs are compared with ``max |out - ref| / (1 + |ref|) <= 2e-2`` (bfloat16 products
and outputs).  The exit status is 1 when any check failed.

``--predicted PATH`` reads the JSON of ``bench/deviceless_gpu.py --json PATH`` (registers per thread,
spill bytes and shared memory per kernel, compiled for sm_90a on a CPU machine) and prints, first,
the predictions for the kernels this run times, then a ``predicted`` column (regs / spill stores +
loads / smem bytes) next to each default-config decode timing and each append timing, so the first
GPU run sets prediction beside reality.

``--cpu-smoke`` runs every section with tiny shapes in Pallas interpret mode on the CPU (codes
must then be bit-identical; numbers are meaningless).

Usage::

    PYTHONPATH=. python bench/gpu_check.py                      # CUDA device
    PYTHONPATH=. python bench/gpu_check.py --cpu-smoke          # CPU rehearsal of every section
    PYTHONPATH=. python bench/gpu_check.py --sections decode peer --budget decode=60
    PYTHONPATH=. python bench/gpu_check.py --sections ragged engine     # the ragged rounds and the engine
    PYTHONPATH=. python bench/gpu_check.py --predicted predicted.json   # with bench/deviceless_gpu.py's figures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

if "--cpu-smoke" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels.triton.config import query_rows  # noqa: E402
from ninfer_kv.ops import codecs  # noqa: E402
from ninfer_kv.schema.geometry import PlaneOrder  # noqa: E402
from ninfer_kv.schema.layout import PagedKVStorageLayout  # noqa: E402
from ninfer_kv.ops.reference import (  # noqa: E402
    cyclic_append_reference,
    cyclic_attention_reference,
    paged_append_reference,
    paged_attention_reference,
)
from ninfer_kv.schema.profiles import KVCodec, KVProfile  # noqa: E402
from ninfer_kv.ops.views import CyclicKVCacheLayerView, CyclicKVLayout, PagedKVBatchLayerView  # noqa: E402
from ninfer_kv.ops.views import allocate_planes

PAGE = 64
PROFILES = [p.value for p in KVProfile]
ORDERS = ["page-major", "head-major"]
SECTIONS = ("setup", "decode", "peer", "large", "correctness", "append", "ragged", "engine")
DEFAULT_BUDGET = {"setup": 20, "decode": 150, "peer": 60, "large": 60, "correctness": 90, "append": 60, "ragged": 90,
                  "engine": 120}
ATTN_TOL = 2e-2


def log(line: str = "") -> None:
    print(line, flush=True)


def short_error(exc: BaseException) -> str:
    """One table-safe line describing an exception."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"ERROR {type(exc).__name__}: {first[:150]}".replace("|", "/")


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Problem sizes of one run (the GPU run, or the tiny CPU rehearsal)."""

    bandwidth_elems: int = 1 << 30  # float32 elements of the bandwidth probes (4 GiB)
    batch: int = 64
    kv_heads: int = 8
    q_heads: int = 32
    head_dim: int = 128
    contexts: tuple = (32768, 8192)  # 32K first
    decode_cases: tuple = tuple((p, o) for p in ("bf16", "k8v4") for o in ORDERS)
    decode_variants: bool = True  # tuning variants of ours at the first context
    peer_sweep: tuple = tuple((ppcb, s) for ppcb in (1, 2, 4) for s in (1, 2, 4, 8, 16))  # (ppcb, k_splits)
    large_pages: int = 40000  # K8V4, H = 8, D = 128: the FP8 key plane is 2.44 GiB
    large_batch: int = 16
    large_context: int = 32768
    append_shapes: tuple = ((64, 1), (8, 256))
    append_cases: tuple = tuple((p, o, dt) for p in ("bf16", "k8v4") for o in ORDERS for dt in ("bfloat16", "float32"))
    append_context: int = 8192
    iters: int = 50
    small_head_dim: int = 128
    small_gqa: tuple = ((8, 64), (8, 256))  # (G, D) extra correctness cases
    gqa_q_dtypes: tuple = ("bfloat16", "float32")
    ragged_rounds: tuple = ()  # RaggedRound; default RAGGED_ROUNDS
    ragged_profiles: tuple = ("bf16", "k8v4")
    ragged_iters: int = 20  # timed single calls per median
    ragged_warmup: int = 2  # untimed calls first
    ragged_check_queries: int = 16  # queries of each chunk slice the reference recomputes
    engine_model: dict | None = None  # ModelConfig fields; default ENGINE_MODEL
    engine_workload: tuple = (16, 512, 256)  # (requests, prompt tokens, generated tokens each)
    engine_max_model_len: int = 1024
    smoke: bool = False

    def rounds(self) -> tuple:
        """The ragged section's rounds."""
        return self.ragged_rounds or RAGGED_ROUNDS


@dataclasses.dataclass(frozen=True)
class RaggedRound:
    """One ragged round: row ``r`` holds ``kv_lens[r]`` tokens after the round, of which it feeds the
    last ``q_lens[r]`` (1: a decode; more: a prefill chunk), all rows' tokens on one token axis."""

    name: str
    kv_lens: tuple
    q_lens: tuple

    def __post_init__(self):
        if len(self.kv_lens) != len(self.q_lens) or not self.kv_lens:
            raise ValueError(f"round {self.name!r}: kv_lens ({len(self.kv_lens)} rows) and q_lens "
                             f"({len(self.q_lens)} rows) must be non-empty and of one length")
        for r, (kv, q) in enumerate(zip(self.kv_lens, self.q_lens)):
            if not 1 <= q <= kv:
                raise ValueError(f"round {self.name!r}, row {r}: q_lens={q} must be in [1, kv_lens={kv}]")

    @property
    def rows(self) -> int:
        return len(self.kv_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))

    @property
    def positions(self) -> np.ndarray:
        """int32 ``(R,)``: the position of each row's first token this round."""
        return (np.asarray(self.kv_lens) - np.asarray(self.q_lens)).astype(np.int32)

    @property
    def query_starts(self) -> np.ndarray:
        """int32 ``(R + 1,)``: row ``r`` owns tokens ``[query_starts[r], query_starts[r + 1])``."""
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)


RAGGED_ROUNDS = (
    # the chunk's last token sits at position 3999 and the last decode's frontier inside a page
    RaggedRound("8 decodes at 4K + a 1024-token chunk", (4096,) * 7 + (4096 - 37, 4000), (1,) * 8 + (1024,)),
    RaggedRound("64 decodes at 2K", (2048,) * 63 + (2048 - 37,), (1,) * 64),
)
"""The ragged section's rounds on a device."""

ENGINE_MODEL = dict(vocab_size=32000, d_model=1024, num_layers=4, num_heads=32, num_kv_heads=8, head_dim=128,
                    mlp_dim=3072, dtype="bfloat16")
"""The engine section's model on a device (random weights, about 0.14 B parameters)."""


# The CPU rehearsal runs every code path once with the fewest distinct kernels (each one costs an
# interpret-mode compilation): one decode case (the peer's), two peer settings, one append per
# K/V dtype.
SMOKE = Shapes(
    bandwidth_elems=1 << 12, batch=2, kv_heads=2, q_heads=8, head_dim=64, contexts=(256,),
    decode_cases=(("bf16", "head-major"),), decode_variants=False, peer_sweep=((1, 2), (2, 1)), large_pages=24,
    large_batch=2, large_context=256, append_shapes=((2, 3),),
    append_cases=(("bf16", "page-major", "bfloat16"), ("bf16", "page-major", "float32")), append_context=256,
    iters=2, small_head_dim=64, small_gqa=((8, 64),), gqa_q_dtypes=("float32",),
    ragged_rounds=(RaggedRound("2 decodes at 192 + a 40-token chunk", (192, 192 - 37, 150), (1, 1, 40)),),
    ragged_profiles=("bf16",), ragged_iters=1, ragged_warmup=1, ragged_check_queries=4,
    engine_model=dict(vocab_size=256, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                      mlp_dim=128, dtype="float32"),
    engine_workload=(3, 40, 3), engine_max_model_len=128, smoke=True,
)


class Section:
    """A budgeted section: ``left()`` seconds remain; ``has(s)`` says whether ``s`` more fit."""

    def __init__(self, name: str, seconds: float):
        self.name, self.seconds, self.start = name, seconds, time.perf_counter()
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def has(self, seconds: float, what: str) -> bool:
        if self.left() >= seconds:
            return True
        self.skipped.append(what)
        return False


class Checks:
    """Counts failures and prints one markdown row per check."""

    def __init__(self):
        self.failures = 0
        self.passed = 0

    def header(self) -> None:
        log("| check | profile | order | metric | value | result |")
        log("|---|---|---|---|---|---|")

    def row(self, check, profile, order, metric, value, ok: bool) -> None:
        self.failures += 0 if ok else 1
        self.passed += 1 if ok else 0
        log(f"| {check} | {profile} | {order} | {metric} | {value} | {'PASS' if ok else 'FAIL'} |")

    def error(self, check, profile, order, exc) -> None:
        self.row(check, profile, order, "exception", short_error(exc), False)
        traceback.print_exc(file=sys.stdout)

    def failed_row(self, cells: list, blanks: int, exc) -> None:
        """A timing table's row for a case that raised: its leading ``cells``, the error, ``blanks``
        empty cells and FAIL; the traceback follows."""
        self.failures += 1
        log("| " + " | ".join(map(str, cells)) + f" | {short_error(exc)} |" + "  |" * blanks + " FAIL |")
        traceback.print_exc(file=sys.stdout)


# -- pools -----------------------------------------------------------------------------------------


def _hash32(x: jax.Array) -> jax.Array:
    """A uint32 -> uint32 mixing function (elementwise, fuses into whatever produces ``x``)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _finite_from_bits(h: jax.Array, dtype, scale_plane: bool) -> jax.Array:
    """Finite values of a plane dtype from hash bits (bf16 |x| in [2^-7, 2); e4m3fn never NaN)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16:
        r = h.astype(jnp.uint16)
        bits = (r & jnp.uint16(0x807F)) | ((jnp.uint16(120) + ((r >> 7) & jnp.uint16(7))) << 7)
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    r = h.astype(jnp.uint8)
    if dtype == jnp.float8_e4m3fn:
        return jax.lax.bitcast_convert_type(r & jnp.uint8(0xBF), jnp.float8_e4m3fn)
    if scale_plane:  # NVFP4 scale bytes: moderate positive e4m3 values
        r = (r & jnp.uint8(0x0F)) | jnp.uint8(0x30)
    return jax.lax.bitcast_convert_type(r, dtype)


def hashed_planes(layout: PagedKVStorageLayout, num_pages: int, seed: int) -> dict:
    """Finite planes whose every byte is a hash of (page ID, layer, head, column, lane, seed).

    Made on the device by one fused elementwise computation per plane (nothing but the plane is
    allocated), so two pages never hold the same bytes and a wrong page address reads wrong data.
    """
    axis = layout.order.page_axis
    out = {}
    for i, (name, shape) in enumerate(layout.plane_shapes(num_pages).items()):
        dtype = layout.plane_dtypes()[name]

        @jax.jit
        def make(shape=shape, dtype=dtype, name=name, salt=seed * 16 + i):
            inner = jnp.zeros(shape, jnp.uint32)
            for dim in range(len(shape)):
                if dim != axis:
                    inner = inner * jnp.uint32(shape[dim]) + jax.lax.broadcasted_iota(jnp.uint32, shape, dim)
            page = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
            h = _hash32(_hash32(inner + jnp.uint32((salt * 0x01000193) & 0xFFFFFFFF)) ^ (page * jnp.uint32(0x9E3779B9)))
            return _finite_from_bits(h, dtype, name.endswith("_scale"))

        out[name] = make()
    return out


def shuffled_tables(rs, bsz: int, blocks: int, n_pages: int, spare_rows: int = 2):
    """Block tables ``(B + spare, blocks)``: distinct random pages of ``[0, n_pages)``, rows shuffled.

    The pages are the highest ``B * blocks`` page IDs of the pool in random order, so a pool with
    spare pages puts every row's data near the end of the planes (past 2**31 elements in the
    ``large`` case).  Unused table rows and entries hold out-of-range IDs (never read).
    """
    need = bsz * blocks
    phys = (n_pages - need + rs.permutation(need)).astype(np.int32)
    table = np.full((bsz + spare_rows, blocks), -1, np.int32)
    rows = rs.permutation(bsz + spare_rows)[:bsz].astype(np.int32)
    for b in range(bsz):
        table[rows[b]] = phys[b * blocks : (b + 1) * blocks]
    return table, rows


def reference_pool(profile, order, *, head_dim, kv_heads, kv_lens, seed, num_layers=2):
    """A small NaN-filled pool holding ``kv_lens[b]`` reference-encoded tokens per row in layer 1."""
    rs = np.random.RandomState(seed)
    bsz = len(kv_lens)
    blocks = -(-max(kv_lens) // PAGE) + 2
    n_pages = bsz * blocks + 3
    table, rows = shuffled_tables(rs, bsz, blocks, n_pages - 3)
    lay = PagedKVStorageLayout(profile, num_layers, kv_heads, head_dim, order)
    view = PagedKVBatchLayerView(allocate_planes(lay, n_pages, fill=float("nan")), jnp.asarray(table), 1, lay)
    t = max(kv_lens)
    k = jax.random.normal(jax.random.key(seed + 1), (bsz, t, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(jax.random.key(seed + 2), (bsz, t, kv_heads, head_dim), jnp.float32)
    zeros = jnp.zeros((bsz,), jnp.int32)
    view = jax.jit(paged_append_reference)(view, jnp.asarray(rows), zeros, k, v, jnp.asarray(kv_lens, jnp.int32))
    return view, rows


# -- comparisons -----------------------------------------------------------------------------------


def max_rel_err(got, want) -> float:
    g = np.asarray(jnp.asarray(got, jnp.float32))
    w = np.asarray(jnp.asarray(want, jnp.float32))
    if not np.isfinite(g).all():
        return float("inf")
    return float(np.max(np.abs(g - w) / (1.0 + np.abs(w)))) if g.size else 0.0


def written_tokens(table, rows, positions, valid, t_len: int, n_pages: int):
    """``(b, t, page, column)`` of every token an append writes (numpy, by the op's rules)."""
    out = []
    c_rows, width = table.shape
    for b, row in enumerate(rows):
        if not 0 <= row < c_rows:
            continue
        for t in range(min(int(valid[b]), t_len)):
            p = int(positions[b]) + t
            if 0 <= p < width * PAGE and 0 <= table[row, p // PAGE] < n_pages:
                out.append((b, t, int(table[row, p // PAGE]), p % PAGE))
    return np.asarray(out, np.int64).reshape(-1, 4)


def _uint_view(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


@jax.jit
def _changed_rows(before, after):
    """bool ``before != after`` on the raw bits, reduced over the lane axis."""
    return jnp.any(_uint_view(before) != _uint_view(after), axis=-1)


def _gather_tokens(plane, layer: int, order: PlaneOrder, pages, cols) -> np.ndarray:
    """Raw values ``(n, H, X)`` of the given (page, column) tokens of one layer (host numpy)."""
    pages, cols = jnp.asarray(pages, jnp.int32), jnp.asarray(cols, jnp.int32)
    # Advanced indices separated by a slice: the index dimension comes first, (n, H, X) either way.
    x = plane[layer, pages, :, cols] if order is PlaneOrder.PAGE_MAJOR else plane[layer, :, pages, cols]
    return np.asarray(_uint_view(x))


def _code_steps(codec: KVCodec, got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Distance in code steps between two code arrays of ``codec`` (raw unsigned bits)."""
    if codec is KVCodec.INT8_G64:
        return np.abs(got.view(np.int8).astype(np.int32) - want.view(np.int8).astype(np.int32))

    def ordered(bits, sign_bit, mag_mask):
        mag = (bits & mag_mask).astype(np.int64)
        return np.where(bits & sign_bit, -mag, mag)

    if codec is KVCodec.NVFP4_G16:
        lo = np.abs(ordered(got & 0xF, 0x8, 0x7) - ordered(want & 0xF, 0x8, 0x7))
        hi = np.abs(ordered(got >> 4, 0x8, 0x7) - ordered(want >> 4, 0x8, 0x7))
        return np.maximum(lo, hi)
    if codec is KVCodec.FP8_E4M3FN_ROW:
        return np.abs(ordered(got, 0x80, 0x7F) - ordered(want, 0x80, 0x7F))
    return np.abs(ordered(got.astype(np.int64), 0x8000, 0x7FFF) - ordered(want.astype(np.int64), 0x8000, 0x7FFF))


_encode_cpu = jax.jit(codecs.encode_kv, static_argnums=0)


def _cpu_device():
    """The CPU device for reference bits (``None`` when ``JAX_PLATFORMS`` hides the CPU backend)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def compare_append(view_before, view_after, table, rows, positions, valid, k, v, *, exact: bool) -> tuple[bool, str]:
    """Compare an append by its written tokens; returns (ok, description).

    Written tokens: codes within one code step of the CPU reference encoding (``exact``: equal),
    scales equal; every other byte of every plane equal to the plane before the append.
    """
    lay = view_before.layout
    n_pages = view_before.num_pages
    t_len = k.shape[1]
    tok = written_tokens(np.asarray(table), np.asarray(rows), np.asarray(positions), np.asarray(valid), t_len, n_pages)
    layer = int(view_before.layer)
    want = {}
    if len(tok):
        sel = (jnp.asarray(tok[:, 0]), jnp.asarray(tok[:, 1]))
        cpu = _cpu_device()  # without one the reference encoding runs on the default device
        k_cpu = jax.device_put(np.asarray(jnp.asarray(k)[sel].astype(jnp.float32)), cpu)
        v_cpu = jax.device_put(np.asarray(jnp.asarray(v)[sel].astype(jnp.float32)), cpu)
        want = {n: np.asarray(_uint_view(a)) for n, a in _encode_cpu(lay.profile, k_cpu, v_cpu).items()}
    untouched = steps_max = inexact = total = 0
    scale_bad = 0
    for spec in lay.profile.planes(lay.head_dim):
        name = spec.name
        changed = np.array(_changed_rows(view_before.planes[name], view_after.planes[name]))  # (L, ., ., P)
        if len(tok):
            if lay.order is PlaneOrder.PAGE_MAJOR:
                changed[layer, tok[:, 2], :, tok[:, 3]] = False
            else:
                changed[layer, :, tok[:, 2], tok[:, 3]] = False
        untouched += int(changed.sum())
        if not len(tok):
            continue
        got = _gather_tokens(view_after.planes[name], layer, lay.order, tok[:, 2], tok[:, 3])
        if spec.role == "scale":
            scale_bad += int(np.sum(got != want[name]))
        else:
            steps = _code_steps(spec.codec, got, want[name])
            steps_max = max(steps_max, int(steps.max()))
            inexact += int(np.sum(steps > 0))
            total += steps.size
    limit = 0 if exact else 1
    ok = untouched == 0 and scale_bad == 0 and steps_max <= limit and len(tok) > 0
    desc = (f"{len(tok)} tokens; codes exact {1 - inexact / max(total, 1):.6f}, max step {steps_max}; "
            f"scales differing {scale_bad}; other bytes changed {untouched}")
    return ok, desc


def check_attention_rows(out, q, view, rows, positions, kv_lens, sel, sm_scale=None) -> float:
    """Max relative error of ``out[sel]`` against the float32 reference on those rows."""
    sel = np.asarray(sel)
    want = jax.jit(paged_attention_reference, static_argnames=("sm_scale",))(
        q[sel], view, jnp.asarray(np.asarray(rows)[sel]), jnp.asarray(np.asarray(positions)[sel]),
        jnp.asarray(np.asarray(kv_lens)[sel]), sm_scale=sm_scale,
    )
    return max_rel_err(out[sel], want)


# -- timing ----------------------------------------------------------------------------------------


def timed(fn, *args, iters: int):
    """Seconds per call of ``iters`` back-to-back calls with one wait (after a warm-up); returns (s, out)."""
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters, out


def _planes_bytes_read(profile: str, bsz: int, ctx: int, kv_heads: int, head_dim: int) -> int:
    return bsz * ctx * kv_heads * KVProfile.parse(profile).token_head_bytes(head_dim)


# -- sections --------------------------------------------------------------------------------------


def section_setup(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    from ninfer_kv import ops
    from ninfer_kv.ops import registry

    checks.header()
    chosen = registry.resolve_impl("auto", platform="gpu").name
    checks.row("impl='auto' on a GPU", "-", "-", "resolves to", chosen, chosen == "pallas")
    if not shapes.smoke:
        here = registry.resolve_impl("auto").name
        checks.row("impl='auto' here", "-", "-", "resolves to", here, here == "pallas")
        view, rows = reference_pool("k8v4", "page-major", head_dim=128, kv_heads=2, kv_lens=[100, 200], seed=5)
        q = jax.random.normal(jax.random.key(3), (2, 1, 8, 128), jnp.bfloat16)
        args = (q, view, jnp.asarray(rows), jnp.array([99, 199], jnp.int32), jnp.array([100, 200], jnp.int32))
        auto = jax.jit(ops.paged_attention)(*args)
        direct = jax.jit(pk.paged_attention)(*args)
        same = bool(np.array_equal(np.asarray(auto).view(np.uint16), np.asarray(direct).view(np.uint16)))
        checks.row("auto op call", "k8v4", "page-major", "bits equal to pallas_kernels", same, same)
    n = shapes.bandwidth_elems
    x = jnp.ones((n,), jnp.float32)
    iters = max(2, shapes.iters // 5)
    t_copy, _ = timed(jax.jit(lambda a: a + 1.0), x, iters=iters)
    t_read, _ = timed(jax.jit(lambda a: jnp.sum(a)), x, iters=iters)
    del x
    state["copy_bw"] = 2 * n * 4 / t_copy
    state["read_bw"] = n * 4 / t_read
    log("")
    log(f"HBM bandwidth over {n * 4 / 2**30:.3g} GiB: copy (x + 1, read + write) {state['copy_bw'] / 1e9:.0f} GB/s; "
        f"read-only (sum) {state['read_bw'] / 1e9:.0f} GB/s")


def _bw_cols(nbytes: int, seconds: float, state: dict) -> str:
    gbs = nbytes / seconds
    return (f"{seconds * 1e6:.0f} | {nbytes / 1e9:.3g} | {gbs / 1e9:.0f} | {100 * gbs / state['read_bw']:.0f}% | "
            f"{100 * gbs / state['copy_bw']:.0f}%")


_BW_HEADER = ("| kernel | profile | order | context | config | time (us) | K/V bytes read (GB) | GB/s | "
              "% of read BW | % of copy BW | max rel err | result |")


def _decode_problem(shapes, profile, order, ctx, n_pages, rs, bsz, seed):
    blocks = ctx // PAGE
    table, rows = shuffled_tables(rs, bsz, blocks, n_pages)
    lay = PagedKVStorageLayout(profile, 1, shapes.kv_heads, shapes.head_dim, order)
    view = PagedKVBatchLayerView(hashed_planes(lay, n_pages, seed), jnp.asarray(table), 0, lay)
    q = jax.random.normal(jax.random.key(seed), (bsz, 1, shapes.q_heads, shapes.head_dim), jnp.bfloat16)
    lens = np.full((bsz,), ctx, np.int32)
    lens[-1] = ctx - 37  # a frontier inside a page
    return view, table, rows, q, jnp.asarray(lens - 1), jnp.asarray(lens)


def _check_rows(table, rows, bsz, n_pages, elements_per_page):
    """Rows to check: the first, the last, and the one with the most pages past 2**31 elements."""
    high = [(int(np.sum(table[r] * elements_per_page >= 2**31)), b) for b, r in enumerate(rows)]
    best = max(high)[1]
    return sorted({0, bsz - 1, best})


# -- predictions of bench/deviceless_gpu.py ---------------------------------------------------------


def load_predicted(path: str) -> dict:
    """``{(kind, profile, order, head_dim): kernel record}`` from ``bench/deviceless_gpu.py --json``."""
    with open(path) as f:
        data = json.load(f)
    out = {(k["kind"], k["profile"], k["order"], int(k["head_dim"])): k for k in data["kernels"]}
    out["_meta"] = {key: data.get(key) for key in ("arch", "jax", "triton", "ptxas", "summary")}
    return out


def predicted_cell(state: dict, kind: str, profile: str, order: str, head_dim: int) -> str:
    """``regs / spill bytes / smem bytes`` predicted for one kernel (``-`` when not in the JSON)."""
    k = state.get("predicted", {}).get((kind, profile, order, head_dim))
    if k is None:
        return "-"
    if k.get("error"):
        return "compile error"
    return f"{k['regs']} / {k['spill_stores'] + k['spill_loads']} / {k['smem']}"


def _pred_col(state: dict, kind: str, profile: str, order: str, head_dim: int) -> str:
    """A trailing ``predicted`` table cell, or nothing without ``--predicted``."""
    return f" {predicted_cell(state, kind, profile, order, head_dim)} |" if "predicted" in state else ""


def _pred_head(state: dict) -> tuple[str, str]:
    return (" predicted regs / spill B / smem B |", "---|") if "predicted" in state else ("", "")


def log_predictions(shapes: "Shapes", state: dict) -> None:
    """The deviceless predictions for the kernels this run times (default configs)."""
    meta = state["predicted"]["_meta"]
    log(f"Compiled for {meta['arch']} without a GPU by bench/deviceless_gpu.py (jax {meta['jax']}, triton "
        f"{meta['triton']}, ptxas {meta['ptxas']}); XLA compiles the same Triton IR with its own Triton here, "
        "so expect small differences.")
    log("")
    log("| kernel | profile | order | D | warps | stages | regs | spill bytes (st/ld) | smem bytes |")
    log("|---|---|---|---|---|---|---|---|---|")
    d = shapes.head_dim
    wanted = [("decode", p, o) for p, o in shapes.decode_cases]
    wanted += [("append-decode" if t == 1 else "append-chunk", p, o)
               for _, t in shapes.append_shapes for p, o, _ in shapes.append_cases]
    for kind, profile, order in dict.fromkeys(wanted):
        k = state["predicted"].get((kind, profile, order, d))
        if k is None:
            log(f"| {kind} | {profile} | {order} | {d} | not in the JSON |  |  |  |  |")
        elif k.get("error"):
            log(f"| {kind} | {profile} | {order} | {d} | {k['error'][:120].replace('|', '/')} |  |  |  |  |")
        else:
            log(f"| {kind} | {profile} | {order} | {d} | {k['num_warps']} | {k['num_stages']} | {k['regs']} | "
                f"{k['spill_stores']}/{k['spill_loads']} | {k['smem']} |")
    s = meta.get("summary") or {}
    if s:
        log("")
        log(f"All {s.get('kernels')} kernels compiled: max {s.get('max_regs')} registers/thread, "
            f"{len(s.get('spilling', []))} spilling, max smem {s.get('max_smem')} B.")


def section_decode(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    bsz, h, hq, d = shapes.batch, shapes.kv_heads, shapes.q_heads, shapes.head_dim
    log(f"B={bsz}, H={h}, Hq={hq}, D={d}, one query per row, {shapes.iters} back-to-back calls per timing.")
    log("")
    log(_BW_HEADER + _pred_head(state)[0])
    log("|---|---|---|---|---|---|---|---|---|---|---|---|" + _pred_head(state)[1])
    rs = np.random.RandomState(0)
    for ctx in shapes.contexts:
        for profile, order in shapes.decode_cases:
            if not sec.has(15, f"{profile} {order} {ctx}"):
                continue
            try:
                n_pages = bsz * ctx // PAGE
                view, table, rows, q, pos, lens = _decode_problem(shapes, profile, order, ctx, n_pages, rs, bsz, ctx)
                nbytes = _planes_bytes_read(profile, bsz, ctx, h, d)
                configs = [("default", None)]
                if shapes.decode_variants and profile == "bf16" and order == "page-major" and ctx == shapes.contexts[0]:
                    configs += [(f"k_splits={s}", pk.PagedAttentionConfig(k_splits=s)) for s in (4, 16)]
                    configs += [("block_k=128", pk.PagedAttentionConfig(block_k=128)),
                                ("num_warps=8", pk.PagedAttentionConfig(compiler=pk.TritonConfig(num_warps=8))),
                                ("num_stages=3", pk.PagedAttentionConfig(compiler=pk.TritonConfig(num_stages=3)))]
                for label, cfg in configs:
                    if not sec.has(5, f"{profile} {order} {ctx} {label}"):
                        break
                    fn = jax.jit(lambda q, v, r, p, n, cfg=cfg: pk.paged_attention(q, v, r, p, n, config=cfg))
                    seconds, out = timed(fn, q, view, jnp.asarray(rows), pos, lens, iters=shapes.iters)
                    r = (cfg or pk.PagedAttentionConfig()).resolve(
                        num_queries=1, group=hq // h, head_dim=d, batch=bsz, kv_heads=h, max_keys=ctx)
                    sel = _check_rows(table, rows, bsz, n_pages, h * PAGE * d)
                    err = check_attention_rows(out, q, view, rows, pos, lens, sel)
                    ok = err <= ATTN_TOL
                    checks.failures += 0 if ok else 1
                    warps = ((cfg and cfg.compiler) or pk.TritonConfig()).for_attention(
                        d, query_rows(r.block_q, hq // h)).num_warps
                    desc = f"{label} (q{r.block_q} k{r.block_k} s{r.k_splits} w{warps})"
                    log(f"| ours | {profile} | {order} | {ctx} | {desc} | {_bw_cols(nbytes, seconds, state)} | "
                        f"{err:.1e} | {'PASS' if ok else 'FAIL'} |"
                        + (_pred_col(state, "decode", profile, order, d) if label == "default" else
                           (" (other config) |" if "predicted" in state else "")))
                    state.setdefault("ours", {})[(profile, order, ctx, label)] = seconds
                if profile == "bf16" and order == "head-major":
                    state.setdefault("peer_inputs", {})[ctx] = (view, table, rows, q, pos, lens)
                del view
            except Exception as exc:
                checks.failed_row(["ours", profile, order, ctx], 6, exc)


def section_peer(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as peer
    except Exception as exc:  # the Triton peer may be gone in newer JAX
        log(f"(JAX peer unavailable: {type(exc).__name__}: {exc})")
        return
    interpret = jax.default_backend() == "cpu"
    h, d = shapes.kv_heads, shapes.head_dim
    log("BF16, head-major pages (the peer's layout: one layer's `(H, N, 64, D)` slice), same data as `decode`; "
        "the peer has no score scale, so ours runs with sm_scale=1 for the comparison.")
    log("")
    log(_BW_HEADER)
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ctx, (view, table, rows, q, pos, lens) in state.get("peer_inputs", {}).items():
        bsz = q.shape[0]
        k_pages = view.planes["k"][0]
        v_pages = view.planes["v"][0]
        per_row = jnp.asarray(table[rows])
        blocks = per_row.shape[1]
        nbytes = _planes_bytes_read("bf16", bsz, ctx, h, d)
        ours = jax.jit(lambda q, v, r, p, n: pk.paged_attention(q, v, r, p, n, sm_scale=1.0))(
            q, view, jnp.asarray(rows), pos, lens)
        best = None
        for ppcb, splits in shapes.peer_sweep:
            if blocks % (ppcb * splits):
                continue
            if not sec.has(5, f"peer ppcb={ppcb} k_splits={splits} {ctx}"):
                continue
            try:
                fn = jax.jit(lambda q, k, v, t, n, ppcb=ppcb, splits=splits: peer.paged_attention(
                    q, k, v, t, n, pages_per_compute_block=ppcb, k_splits=splits, interpret=interpret))
                seconds, out = timed(fn, q[:, 0], k_pages, v_pages, per_row, lens, iters=shapes.iters)
                err = max_rel_err(out, ours[:, 0])
                ok = err <= ATTN_TOL
                checks.failures += 0 if ok else 1
                log(f"| JAX peer | bf16 | head-major | {ctx} | ppcb={ppcb} k_splits={splits} | "
                    f"{_bw_cols(nbytes, seconds, state)} | {err:.1e} vs ours | {'PASS' if ok else 'FAIL'} |")
                if best is None or seconds < best[0]:
                    best = (seconds, ppcb, splits)
            except Exception as exc:
                checks.failures += 1
                log(f"| JAX peer | bf16 | head-major | {ctx} | ppcb={ppcb} k_splits={splits} | "
                    f"{short_error(exc)} |  |  |  |  |  | FAIL |")
        ours_s = state.get("ours", {}).get(("bf16", "head-major", ctx, "default"))
        if best is not None and ours_s is not None:
            state.setdefault("notes", []).append(
                f"{ctx} context, BF16 head-major: ours {ours_s * 1e6:.0f} us, best JAX peer {best[0] * 1e6:.0f} us "
                f"(ppcb={best[1]}, k_splits={best[2]}): ours / peer = {ours_s / best[0]:.2f}")
        del k_pages, v_pages
    state.pop("peer_inputs", None)


def section_large(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    h, d, n_pages = 8 if not shapes.smoke else shapes.kv_heads, 128 if not shapes.smoke else shapes.head_dim, \
        shapes.large_pages
    bsz, ctx = shapes.large_batch, shapes.large_context
    lay = PagedKVStorageLayout("k8v4", 1, h, d, "page-major")
    per_page = h * PAGE * d  # FP8 key elements per page
    key_elems = n_pages * per_page
    log(f"K8V4 page-major, H={h}, D={d}, N={n_pages} pages: FP8 key plane {key_elems / 2**30:.2f} GiB "
        f"({key_elems:.3g} elements; element 2**31 is page {2**31 / per_page:.0f}). B={bsz}, context {ctx}.")
    log("")
    checks.header()
    rs = np.random.RandomState(3)
    blocks = ctx // PAGE
    # Rows over a random permutation of the whole pool: pages on both sides of element 2**31.
    phys = rs.permutation(n_pages)[: bsz * blocks].astype(np.int32)
    table = np.full((bsz + 1, blocks), -1, np.int32)
    rows = rs.permutation(bsz + 1)[:bsz].astype(np.int32)
    for b in range(bsz):
        table[rows[b]] = phys[b * blocks : (b + 1) * blocks]
    view = PagedKVBatchLayerView(hashed_planes(lay, n_pages, 11), jnp.asarray(table), 0, lay)
    high = int(np.sum(phys * per_page >= 2**31))
    log(f"({high} of {len(phys)} table pages lie past element 2**31)")
    try:
        # Append one token per row at a position whose page is the row's highest page ID.
        pos = np.array([int(np.argmax(table[r])) * PAGE + 17 for r in rows], np.int32)
        k = jax.random.normal(jax.random.key(1), (bsz, 1, h, d), jnp.float32)
        v = jax.random.normal(jax.random.key(2), (bsz, 1, h, d), jnp.float32)
        valid = jnp.ones((bsz,), jnp.int32)
        after = jax.jit(pk.paged_append)(view, jnp.asarray(rows), jnp.asarray(pos), k, v, valid)
        ok, desc = compare_append(view, after, table, rows, pos, valid, k, v, exact=shapes.smoke)
        checks.row("append into high pages", "k8v4", "page-major", "written tokens", desc, ok)
        view = after
        del after
        if sec.has(10, "large decode"):
            q = jax.random.normal(jax.random.key(4), (bsz, 1, 4 * h, d), jnp.bfloat16)
            lens = jnp.full((bsz,), ctx, jnp.int32)
            seconds, out = timed(jax.jit(pk.paged_attention), q, view, jnp.asarray(rows), lens - 1, lens,
                                 iters=shapes.iters)
            sel = _check_rows(table, rows, bsz, n_pages, per_page)
            err = check_attention_rows(out, q, view, rows, lens - 1, lens, sel)
            nbytes = _planes_bytes_read("k8v4", bsz, ctx, h, d)
            checks.row("decode over high pages", "k8v4", "page-major", "max rel err / time / GB/s",
                       f"{err:.1e} / {seconds * 1e6:.0f} us / {nbytes / seconds / 1e9:.0f}", err <= ATTN_TOL)
    except Exception as exc:
        checks.error("large pool", "k8v4", "page-major", exc)
    del view


def section_correctness(sec: Section, shapes: Shapes, checks: Checks, state: dict, profiles, orders) -> None:
    d, h, g = shapes.small_head_dim, 2, 4
    kv_lens = [70, 0, 130] if shapes.smoke else [100, 0, 200, 64]
    chunk = 16 if shapes.smoke else 64
    checks.header()
    append = jax.jit(pk.paged_append)
    attn = jax.jit(pk.paged_attention, static_argnames=("config",))
    attn_ref = jax.jit(paged_attention_reference)
    bsz = len(kv_lens)
    lens = jnp.asarray(kv_lens, jnp.int32)
    for i, profile in enumerate(profiles):
        for j, order in enumerate(orders):
            if not sec.has(5, f"{profile} {order}"):
                continue
            try:
                view, rows = reference_pool(profile, order, head_dim=d, kv_heads=h, kv_lens=kv_lens, seed=i)
                in_dtype = jnp.float32 if (i + j) % 2 else jnp.bfloat16
                k = jax.random.normal(jax.random.key(10 + i), (bsz, 5, h, d), in_dtype)
                v = jax.random.normal(jax.random.key(20 + i), (bsz, 5, h, d), in_dtype)
                valid = jnp.asarray([5, 0] + [3] * (bsz - 2), jnp.int32)
                after = append(view, jnp.asarray(rows), lens, k, v, valid)
                ok, desc = compare_append(view, after, view.block_tables, rows, lens, valid, k, v, exact=shapes.smoke)
                checks.row(f"paged append ({jnp.dtype(in_dtype).name} K/V)", profile, order, "written tokens", desc, ok)
                q_dtype = jnp.bfloat16 if (i + j) % 2 else jnp.float32
                for name, t, cfg in (
                    ("decode (2 splits)", 1, pk.PagedAttentionConfig(k_splits=2)),
                    (f"chunk T={chunk}", chunk, pk.PagedAttentionConfig()),
                ):
                    q = jax.random.normal(jax.random.key(30 + i + t), (bsz, t, h * g, d), q_dtype)
                    pos = jnp.maximum(lens - t, 0)
                    err = max_rel_err(attn(q, view, jnp.asarray(rows), pos, lens, config=cfg),
                                      attn_ref(q, view, jnp.asarray(rows), pos, lens))
                    checks.row(f"{name}, {jnp.dtype(q_dtype).name} q", profile, order, "max rel err", f"{err:.2e}",
                               err <= ATTN_TOL)
            except Exception as exc:
                checks.error("paged", profile, order, exc)
        if sec.has(5, f"cyclic {profile}"):
            try:
                _cyclic_check(profile, d, h, g, i, checks, exact=shapes.smoke)
            except Exception as exc:
                checks.error("cyclic", profile, "-", exc)
    gqa_profile = "k8v4" if "k8v4" in profiles else profiles[0]
    for gg, dd in shapes.small_gqa:  # GQA 8 at the smallest and largest common head dims
        if not sec.has(5, f"G={gg} D={dd}"):
            continue
        try:
            view, rows = reference_pool(gqa_profile, "head-major", head_dim=dd, kv_heads=1, kv_lens=kv_lens, seed=9)
            for q_dtype in shapes.gqa_q_dtypes:
                q = jax.random.normal(jax.random.key(dd), (bsz, 1, gg, dd), q_dtype)
                err = max_rel_err(attn(q, view, jnp.asarray(rows), lens - 1, lens, config=None),
                                  attn_ref(q, view, jnp.asarray(rows), lens - 1, lens))
                checks.row(f"decode G={gg} D={dd}, {q_dtype} q", gqa_profile, "head-major", "max rel err",
                           f"{err:.2e}", err <= ATTN_TOL)
        except Exception as exc:
            checks.error(f"G={gg} D={dd}", gqa_profile, "head-major", exc)


def _cyclic_check(profile, d, h, g, seed, checks: Checks, *, exact: bool) -> None:
    lay = CyclicKVLayout(profile, 2, 4, h, d, window=32, slots=40)
    view = CyclicKVCacheLayerView(lay.allocate(fill=float("nan")), 1, lay)
    rows = jnp.array([3, 0, 1], jnp.int32)
    k = jax.random.normal(jax.random.key(40 + seed), (3, 50, h, d), jnp.float32)
    v = jax.random.normal(jax.random.key(50 + seed), (3, 50, h, d), jnp.float32)
    zeros = jnp.zeros((3,), jnp.int32)
    lens = jnp.array([50, 0, 37], jnp.int32)
    got = jax.jit(pk.cyclic_append)(view, rows, zeros, k, v, lens)
    want = jax.jit(cyclic_append_reference)(view, rows, zeros, k, v, lens)
    same, steps = 0, 0
    for spec in lay.profile.planes(d):
        gb, wb = np.asarray(_uint_view(got.planes[spec.name])), np.asarray(_uint_view(want.planes[spec.name]))
        if spec.role == "scale" or exact:
            same += int(np.sum(gb != wb))
        else:
            steps = max(steps, int(_code_steps(spec.codec, gb, wb).max()))
    checks.row("cyclic append", profile, "-", "scales (and exact codes) differing / max code step",
               f"{same} / {steps}", same == 0 and steps <= 1)
    q = jax.random.normal(jax.random.key(60 + seed), (3, 4, h * g, d), jnp.bfloat16)
    pos = jnp.maximum(lens - 4, 0)
    err = max_rel_err(jax.jit(pk.cyclic_attention)(q, want, rows, pos, lens),
                      jax.jit(cyclic_attention_reference)(q, want, rows, pos, lens))
    checks.row("cyclic attention T=4", profile, "-", "max rel err", f"{err:.2e}", err <= ATTN_TOL)


def _buffer_pointers(planes: dict) -> dict:
    return {n: p.unsafe_buffer_pointer() for n, p in planes.items()}


@dataclasses.dataclass(frozen=True)
class AppendRun:
    """One timed append case: seconds per call, the comparison with the reference, the figures."""

    seconds: float
    ok: bool
    desc: str
    kept: bool  # donation kept the planes' buffers
    tokens: int
    written: int  # bytes of codes and scales written per call


def run_append(fn, rs, shapes, profile: str, order: str, bsz: int, t: int, in_dtype) -> AppendRun:
    """Time ``fn`` (a jitted, donating ``paged_append``) on a fresh pool with pages in random physical
    order and hashed bits, then compare every written and unwritten row with the reference."""
    h, d = shapes.kv_heads, shapes.head_dim
    blocks = shapes.append_context // PAGE
    n_pages = bsz * blocks
    table, rows = shuffled_tables(rs, bsz, blocks, n_pages)
    lay = PagedKVStorageLayout(profile, 1, h, d, order)
    view = PagedKVBatchLayerView(hashed_planes(lay, n_pages, 7), jnp.asarray(table), 0, lay)
    before = jax.tree_util.tree_map(jnp.copy, view.planes)
    k = jax.random.normal(jax.random.key(2), (bsz, t, h, d), in_dtype)
    v = jax.random.normal(jax.random.key(3), (bsz, t, h, d), in_dtype)
    pos = jnp.asarray(rs.randint(0, shapes.append_context - t, bsz).astype(np.int32))
    valid = jnp.full((bsz,), t, jnp.int32)
    rows_j = jnp.asarray(rows)
    view = fn(view, rows_j, pos, k, v, valid)  # compile and warm up
    jax.block_until_ready(view.planes)
    pointers = _buffer_pointers(view.planes)
    t0 = time.perf_counter()
    for _ in range(shapes.iters):
        view = fn(view, rows_j, pos, k, v, valid)
    jax.block_until_ready(view.planes)
    seconds = (time.perf_counter() - t0) / shapes.iters
    kept = _buffer_pointers(view.planes) == pointers
    base = PagedKVBatchLayerView(before, view.block_tables, 0, lay)
    ok, desc = compare_append(base, view, table, rows, pos, valid, k, v, exact=shapes.smoke)
    tokens = bsz * t
    return AppendRun(seconds, ok, desc, kept, tokens, tokens * h * KVProfile.parse(profile).token_head_bytes(d))


def section_append(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    d = shapes.head_dim
    log(f"Quantize + write in place, planes donated, {shapes.iters} back-to-back calls per timing; pages in random "
        "physical order.")
    log("")
    log("| profile | order | B x T | K/V dtype | time per call (us) | tokens/s | bytes written (GB/s) | "
        "written tokens | donation kept buffers | result |" + _pred_head(state)[0])
    log("|---|---|---|---|---|---|---|---|---|---|" + _pred_head(state)[1])
    rs = np.random.RandomState(1)
    fn = jax.jit(pk.paged_append, donate_argnums=(0,))
    for bsz, t in shapes.append_shapes:
        for profile, order, dt in shapes.append_cases:
            in_dtype = jnp.dtype(dt)
            if not sec.has(8, f"{profile} {order} {bsz}x{t} {dt}"):
                continue
            try:
                run = run_append(fn, rs, shapes, profile, order, bsz, t, in_dtype)
                ok = run.ok and run.kept
                checks.failures += 0 if ok else 1
                seconds = run.seconds
                log(f"| {profile} | {order} | {bsz} x {t} | {dt} | {seconds * 1e6:.1f} | {run.tokens / seconds:.3g} | "
                    f"{run.written / seconds / 1e9:.2f} | {run.desc} | {run.kept} | {'PASS' if ok else 'FAIL'} |"
                    + _pred_col(state, "append-decode" if t == 1 else "append-chunk", profile, order, d))
            except Exception as exc:
                checks.failed_row([profile, order, f"{bsz} x {t}", dt], 4, exc)


# -- ragged rounds -----------------------------------------------------------------------------------


def ragged_ideal_bytes(rnd: RaggedRound, profile: str, kv_heads: int, head_dim: int, block_q: int) -> int:
    """The HBM roofline's bytes of one ragged attention call: each row's queries in blocks of
    ``block_q`` (a decode row: one block of one token), each block reading once, for its whole GQA
    group, every page of each KV head below its last query's frontier (whole pages)."""
    if block_q < 1:
        raise ValueError(f"block_q={block_q} must be >= 1")
    page_bytes = PAGE * kv_heads * KVProfile.parse(profile).token_head_bytes(head_dim)
    total = 0
    for kv, q, pos in zip(rnd.kv_lens, rnd.q_lens, rnd.positions):
        for start in range(0, q, block_q):
            frontier = min(kv, int(pos) + min(start + block_q, q))  # keys [0, frontier) are visible
            total += -(-frontier // PAGE) * page_bytes
    return total


def kernel_block_q(rnd: RaggedRound, impl: str, group: int, head_dim: int, kv_heads: int, max_keys: int) -> int:
    """The query block the native ragged kernels of ``impl`` use for a round's chunk rows
    (``pallas_kernels.common.ragged.chunk_block_q`` with the backend's default rows)."""
    from pallas_kernels.common.ragged import chunk_block_q

    if impl == "pallas_tpu":
        from pallas_kernels.mosaic_tpu.ragged import CHUNK_ROWS as rows
    else:
        from pallas_kernels.triton.ragged import chunk_rows

        rows = chunk_rows(head_dim)
    return chunk_block_q(pk.PagedAttentionConfig(), rows=rows, num_tokens=rnd.num_tokens, group=group,
                         head_dim=head_dim, kv_heads=kv_heads, max_keys=max_keys)


@dataclasses.dataclass
class RaggedProblem:
    """A round on a pool with hashed bytes and pages in random physical order (page-major)."""

    rnd: RaggedRound
    profile: str
    view: PagedKVBatchLayerView
    table: np.ndarray
    rows: np.ndarray  # int32 (R,): each row's table row
    k: jax.Array  # bfloat16 (N, H, D): the tokens the round appends
    v: jax.Array
    q: jax.Array  # bfloat16 (N, Hq, D)

    def args(self) -> tuple:
        """``(table_rows, positions, kv_lens, query_starts)`` as device int32 arrays."""
        return (jnp.asarray(self.rows), jnp.asarray(self.rnd.positions), jnp.asarray(self.rnd.kv_lens, jnp.int32),
                jnp.asarray(self.rnd.query_starts))

    def rect(self, x: jax.Array) -> jax.Array:
        """The ragged ``(N, ...)`` tokens as ``(R, max q_len, ...)`` rows (zeros past each row's tokens)."""
        starts, q_lens = self.rnd.query_starts, self.rnd.q_lens
        t_max = max(q_lens)
        idx = np.zeros((self.rnd.rows, t_max), np.int32)
        real = np.zeros((self.rnd.rows, t_max), bool)
        for r, (s0, q) in enumerate(zip(starts, q_lens)):
            idx[r, :q], real[r, :q] = np.arange(s0, s0 + q), True
        mask = jnp.asarray(real).reshape(real.shape + (1,) * (x.ndim - 1))
        return jnp.where(mask, x[jnp.asarray(idx)], jnp.zeros((), x.dtype))


def ragged_problem(shapes: Shapes, rnd: RaggedRound, profile: str, seed: int) -> RaggedProblem:
    """``rnd`` on a fresh pool of ``profile`` (one layer, page-major), random K/V and queries."""
    h, hq, d = shapes.kv_heads, shapes.q_heads, shapes.head_dim
    rs = np.random.RandomState(seed)
    blocks = -(-max(rnd.kv_lens) // PAGE)
    n_pages = rnd.rows * blocks
    table, rows = shuffled_tables(rs, rnd.rows, blocks, n_pages)
    lay = PagedKVStorageLayout(profile, 1, h, d, "page-major")
    view = PagedKVBatchLayerView(hashed_planes(lay, n_pages, seed), jnp.asarray(table), 0, lay)
    n = rnd.num_tokens
    k = jax.random.normal(jax.random.key(seed + 1), (n, h, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(seed + 2), (n, h, d), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(seed + 3), (n, hq, d), jnp.bfloat16)
    return RaggedProblem(rnd, profile, view, table, rows, k, v, q)


def ragged_check_slices(rnd: RaggedRound, queries: int) -> list[tuple[int, int, int]]:
    """``(row, first query, count)`` the reference recomputes: the first and the last decode row, and
    the first, middle and last ``queries`` queries of every chunk row."""
    decodes = [r for r, q in enumerate(rnd.q_lens) if q == 1]
    out = [(r, 0, 1) for r in dict.fromkeys(decodes[:1] + decodes[-1:])]
    for r, q in enumerate(rnd.q_lens):
        if q > 1:
            m = min(queries, q)
            out += [(r, t0, m) for t0 in dict.fromkeys((0, (q - m) // 2, q - m))]
    return out


def check_ragged_attention(out: jax.Array, prob: RaggedProblem, view: PagedKVBatchLayerView, queries: int) -> float:
    """Max relative error of ``out`` against the float32 reference ragged attention
    (``impl="reference"``) on :func:`ragged_check_slices` of the round, run as a round of its own
    (a slice of a chunk row is a row from that query's position, with the same visible keys)."""
    from ninfer_kv import ops

    rnd = prob.rnd
    slices = ragged_check_slices(rnd, queries)
    tokens = np.concatenate([rnd.query_starts[r] + t0 + np.arange(m) for r, t0, m in slices]).astype(np.int32)
    pos = np.array([rnd.positions[r] + t0 for r, t0, _ in slices], np.int32)
    counts = np.array([m for _, _, m in slices], np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    want = jax.jit(lambda *a: ops.paged_attention_ragged(*a, impl="reference"))(
        prob.q[jnp.asarray(tokens)], view, jnp.asarray(prob.rows[[r for r, _, _ in slices]]), jnp.asarray(pos),
        jnp.asarray(pos + counts), jnp.asarray(starts))
    return max_rel_err(out[jnp.asarray(tokens)], want)


def median_time(fn, *args, iters: int, warmup: int = 2):
    """Median seconds of ``iters`` single calls of ``fn(*args)``, each waited for, after ``warmup``
    calls; returns ``(seconds, last output)``."""
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def median_time_donated(fn, view, *args, iters: int, warmup: int = 2):
    """:func:`median_time` of ``view = fn(view, *args)`` (``fn`` donates the view's planes)."""
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        view = fn(view, *args)
        jax.block_until_ready(view.planes)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return float(np.median(times)), view


RAGGED_HEADER = ("| round | profile | R / N | native | block_q | append (us) | append check | attention (us) | "
                 "ideal bytes (GB) | GB/s | {roof} | max rel err | result |")


def run_ragged_section(sec: Section, shapes: Shapes, checks: Checks, impl: str, roofline, *, roof_header: str,
                       peer=None) -> None:
    """The ``ragged`` section for backend ``impl``: per round and profile, correctness first (the
    append's written tokens, the attention against the float32 reference ragged op), then the
    median time of the append (planes donated) and the attention against the roofline.

    ``roofline(nbytes, seconds)`` gives the cells ``GB/s | <roof_header>`` (one or more cells);
    ``peer(prob, view, out, seconds, nbytes)``, when given, times another kernel on the same bf16
    round (``out``, ``seconds``: ours) and returns ``(table row, note)``; the notes print after the
    table.
    """
    from ninfer_kv import ops
    from ninfer_kv.ops import registry

    loaded = registry.load_impl(impl)
    native = loaded.paged_append_ragged is not None and loaded.paged_attention_ragged is not None
    h, hq, d = shapes.kv_heads, shapes.q_heads, shapes.head_dim
    log(f"impl={impl!r}: native ragged kernels {'yes' if native else 'NO (the generic one-query-per-row form)'}. "
        f"H={h}, Hq={hq}, D={d}, page-major; bfloat16 K/V and queries; median of {shapes.ragged_iters} single "
        f"calls after {shapes.ragged_warmup} untimed.  Ideal bytes: each row's live pages once per KV head per "
        "query block.")
    log("")
    header = RAGGED_HEADER.format(roof=roof_header)
    log(header)
    log("|" + "---|" * (header.count("|") - 1))
    notes = []
    append = jax.jit(lambda *a: ops.paged_append_ragged(*a, impl=impl), donate_argnums=(0,))
    attention = jax.jit(lambda *a: ops.paged_attention_ragged(*a, impl=impl))
    for i, rnd in enumerate(shapes.rounds()):
        for profile in shapes.ragged_profiles:
            if not sec.has(10, f"{rnd.name} {profile}"):
                continue
            cells = [rnd.name, profile, f"{rnd.rows} / {rnd.num_tokens}", "yes" if native else "no"]
            try:
                prob = ragged_problem(shapes, rnd, profile, seed=100 + 10 * i)
                table_rows, positions, kv_lens, starts = prob.args()
                before = prob.view.replace(planes=jax.tree_util.tree_map(jnp.copy, prob.view.planes))
                after = append(prob.view, table_rows, positions, prob.k, prob.v, starts)  # donates prob.view
                ok_append, desc = compare_append(before, after, prob.table, prob.rows, rnd.positions,
                                                 np.asarray(rnd.q_lens, np.int32), prob.rect(prob.k), prob.rect(prob.v),
                                                 exact=shapes.smoke)
                prob.view = before = None  # the pool before the append is no longer needed
                out = attention(prob.q, after, table_rows, positions, kv_lens, starts)
                err = check_ragged_attention(out, prob, after, shapes.ragged_check_queries)
                ok = ok_append and err <= ATTN_TOL
                block_q = kernel_block_q(rnd, impl, hq // h, d, h, after.logical_pages * PAGE)
                nbytes = ragged_ideal_bytes(rnd, profile, h, d, block_q)
                t_attn, out = median_time(attention, prob.q, after, table_rows, positions, kv_lens, starts,
                                          iters=shapes.ragged_iters, warmup=shapes.ragged_warmup)
                peer_row = None
                if peer is not None and profile == "bf16":
                    peer_row, note = peer(prob, after, out, t_attn, nbytes)
                    notes.append(note)
                t_append, after = median_time_donated(append, after, table_rows, positions, prob.k, prob.v, starts,
                                                      iters=shapes.ragged_iters, warmup=shapes.ragged_warmup)
                checks.failures += 0 if ok else 1
                checks.passed += 1 if ok else 0
                log("| " + " | ".join(cells) + f" | {block_q} | {t_append * 1e6:.0f} | "
                    f"{'ok' if ok_append else 'WRONG'}: {desc} | {t_attn * 1e6:.0f} | {nbytes / 1e9:.3g} | "
                    f"{roofline(nbytes, t_attn)} | {err:.1e} | {'PASS' if ok else 'FAIL'} |")
                if peer_row is not None:
                    log(peer_row)
                del prob, after, out
            except Exception as exc:
                checks.failed_row(cells, header.count("|") - len(cells) - 3, exc)
    if notes:
        log("")
    for note in notes:
        log(note)


def section_ragged(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    def roofline(nbytes: int, seconds: float) -> str:
        gbs = nbytes / seconds
        return f"{gbs / 1e9:.0f} | {100 * gbs / state['read_bw']:.0f}%"

    run_ragged_section(sec, shapes, checks, "pallas", roofline, roof_header="% of read BW")


# -- the engine -----------------------------------------------------------------------------------


def run_engine_section(sec: Section, shapes: Shapes, checks: Checks, impl: str) -> None:
    """The ``engine`` section for backend ``impl``: a random decoder served by ``ninfer_kv.LLM``, the
    workload run once to compile and once timed; checks that every request produced its tokens and
    that the rounds were ragged exactly when the model runs ragged natively."""
    from ninfer_kv.engine import LLM, DecoderModel, SamplingParams
    from ninfer_kv.models.decoder import ModelConfig, init_params
    from ninfer_kv.ops import registry

    fields = shapes.engine_model or ENGINE_MODEL
    config = ModelConfig(**fields)
    requests, prompt_len, max_tokens = shapes.engine_workload
    context = shapes.engine_max_model_len
    if prompt_len + max_tokens > context:
        raise ValueError(f"engine workload: prompts of {prompt_len} + {max_tokens} tokens exceed "
                         f"max_model_len={context}")
    model = DecoderModel(init_params(config, seed=0), config, impl=impl)
    llm = LLM(model, max_model_len=context, max_num_seqs=requests, kv_capacity=requests * context,
              enable_prefix_caching=False)
    engine = llm.engine
    resolved = registry.resolve_impl(impl).name
    log(f"Model: {config.num_layers} layers, d_model {config.d_model}, {config.num_heads} / {config.num_kv_heads} "
        f"heads of {config.head_dim}, vocabulary {config.vocab_size}, {config.dtype}, random weights; impl={impl!r} "
        f"({resolved}); {requests} requests of {prompt_len} prompt tokens, {max_tokens} greedy tokens each "
        f"(ignore_eos), prefix caching off, max_num_batched_tokens {engine.max_num_batched_tokens}.")
    log("")
    checks.header()
    native = model.runs_ragged_natively
    checks.row("ragged rounds iff native ragged ops", "-", "-", "native / engine ragged rounds",
               f"{native} / {engine.ragged_rounds}", engine.ragged_rounds == native)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def workload(seed: int):
        rs = np.random.RandomState(seed)
        before = dataclasses.replace(engine.stats)
        for j in range(requests):
            engine.add_request(f"w{seed}-{j}", rs.randint(0, config.vocab_size, prompt_len).tolist(), params)
        done, t0 = {}, time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return time.perf_counter() - t0, done, before

    compile_s, _, _ = workload(1)
    if not sec.has(compile_s, "the timed pass"):
        log(f"(the warm-up pass took {compile_s:.0f} s; no budget left for the timed pass)")
        return
    seconds, done, before = workload(2)
    stats = engine.stats
    units = {kind: getattr(stats, f"{kind}_units") - getattr(before, f"{kind}_units")
             for kind in ("prefill", "decode", "ragged")}
    counts = sorted({len(t) for t in done.values()})
    ok = len(done) == requests and counts == [max_tokens]
    checks.row("every request generated", "-", "-", "requests / token counts", f"{len(done)} / {counts}", ok)
    if engine.ragged_rounds:  # prompts in ragged units, never in prefill units
        ragged_ok = units["ragged"] > 0 and units["prefill"] == 0
    else:
        ragged_ok = units["ragged"] == 0 and units["prefill"] > 0 and units["decode"] > 0
    checks.row("units run", "-", "-", "prefill / decode / ragged",
               f"{units['prefill']} / {units['decode']} / {units['ragged']}", ragged_ok)
    generated = requests * max_tokens
    log("")
    log(f"Engine on {impl!r}: rounds {'RAGGED' if engine.ragged_rounds else 'rectangular (prefill + decode units)'}; "
        f"{generated} tokens generated in {seconds:.2f} s = {generated / seconds:.1f} tokens/s; "
        f"{requests * prompt_len / seconds:.0f} prompt tokens/s over the run; "
        f"{stats.rounds - before.rounds} rounds (warm-up pass with compiles: {compile_s:.1f} s)")


def section_engine(sec: Section, shapes: Shapes, checks: Checks, state: dict) -> None:
    run_engine_section(sec, shapes, checks, "pallas")


_TITLES = {
    "setup": "Setup: implementation choice and HBM bandwidth",
    "decode": "Decode attention",
    "peer": "JAX peer kernel (pages_per_compute_block x k_splits sweep)",
    "large": "A 1-byte plane of 2-4 GiB (offsets past 2**31 elements)",
    "correctness": "Correctness against the reference, small shapes",
    "append": "Append",
    "ragged": "Ragged rounds: decodes beside a prefill chunk",
    "engine": "The engine: a small model through ninfer_kv.LLM",
}


def run_sections(order, budget: dict, titles: dict, sections: dict, checks: Checks) -> None:
    """Run ``sections[name](Section)`` for each name of ``order`` under its budget, each under its own
    heading; a section that raises counts one failure and the next one runs."""
    for name in order:
        sec = Section(name, budget[name])
        log("")
        log(f"## {titles[name]} (budget {budget[name]:.0f} s)" if math.isfinite(budget[name]) else f"## {titles[name]}")
        log("")
        try:
            sections[name](sec)
        except Exception as exc:
            checks.failures += 1
            log(f"section {name} failed: {short_error(exc)}")
            traceback.print_exc(file=sys.stdout)
        log("")
        if sec.skipped:
            log(f"(budget spent: skipped {'; '.join(sec.skipped)})")
        log(f"({name}: {time.perf_counter() - sec.start:.0f} s)")


def parse_budgets(items, smoke: bool, defaults: dict) -> dict:
    """Per-section budgets from ``SECTION=SECONDS`` items over ``defaults``; the CPU rehearsal has
    none unless given (it must run every path)."""
    budget = {name: (math.inf if smoke else seconds) for name, seconds in defaults.items()}
    for item in items or ():
        name, _, seconds = item.partition("=")
        if name not in budget or not seconds:
            raise SystemExit(f"--budget {item!r}: expected SECTION=SECONDS with SECTION one of {', '.join(defaults)}")
        budget[name] = float(seconds)
    return budget


def add_common_arguments(parser: argparse.ArgumentParser, sections, smoke_help: str) -> None:
    """The flags every device check takes: ``--cpu-smoke``, ``--profiles``, ``--orders``,
    ``--sections``, ``--budget``."""
    parser.add_argument("--cpu-smoke", action="store_true", help=smoke_help)
    parser.add_argument("--profiles", nargs="+", default=PROFILES, choices=PROFILES, help="for `correctness`")
    parser.add_argument("--orders", nargs="+", default=ORDERS, choices=ORDERS, help="for `correctness`")
    parser.add_argument("--sections", nargs="+", default=list(sections), choices=sections)
    parser.add_argument("--budget", nargs="*", metavar="SECTION=SECONDS", help="per-section time budgets")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, SECTIONS, "tiny shapes, interpret mode, every section")
    parser.add_argument("--predicted", metavar="PATH", help="bench/deviceless_gpu.py --json output to print beside")
    args = parser.parse_args(argv)
    budget = parse_budgets(args.budget, args.cpu_smoke, DEFAULT_BUDGET)
    shapes = SMOKE if args.cpu_smoke else Shapes()

    backend = jax.default_backend()
    start = time.perf_counter()
    log(f"# Pallas kernel check on {backend}: {jax.devices()[0].device_kind} (jax {jax.__version__})")
    if backend == "cpu" and not args.cpu_smoke:
        log("No GPU: run with --cpu-smoke for the interpret-mode rehearsal.")
        return 2
    if args.cpu_smoke:
        log("(CPU rehearsal, Pallas interpret mode, tiny shapes: the numbers are meaningless)")
    elif _cpu_device() is None:
        log("(no CPU backend in JAX_PLATFORMS: append reference bits come from the default device)")
    checks = Checks()
    state: dict = {"copy_bw": float("nan"), "read_bw": float("nan")}
    if args.predicted:
        state["predicted"] = load_predicted(args.predicted)
        log("")
        log("## Predicted by the deviceless compile (sm_90a, no GPU)")
        log("")
        log_predictions(shapes, state)
    order = [s for s in SECTIONS if s in args.sections]
    if "setup" not in order and ("decode" in order or "peer" in order or "ragged" in order):
        order.insert(0, "setup")  # the bandwidth baselines are the denominators
    if "peer" in order and "decode" not in order:
        order.insert(order.index("peer"), "decode")  # the peer reuses decode's pools
    sections = {
        "setup": lambda sec: section_setup(sec, shapes, checks, state),
        "decode": lambda sec: section_decode(sec, shapes, checks, state),
        "peer": lambda sec: section_peer(sec, shapes, checks, state),
        "large": lambda sec: section_large(sec, shapes, checks, state),
        "correctness": lambda sec: section_correctness(sec, shapes, checks, state, args.profiles, args.orders),
        "append": lambda sec: section_append(sec, shapes, checks, state),
        "ragged": lambda sec: section_ragged(sec, shapes, checks, state),
        "engine": lambda sec: section_engine(sec, shapes, checks, state),
    }
    run_sections(order, budget, _TITLES, sections, checks)
    for note in state.get("notes", []):
        log(note)
    log("")
    log(f"{checks.failures} failing checks, {checks.passed} passing table checks "
        f"({time.perf_counter() - start:.0f} s)")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
