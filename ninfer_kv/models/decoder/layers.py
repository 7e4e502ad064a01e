"""Building blocks of the decoder: RMSNorm, rotary position embedding (with scaling), gated MLPs
(SwiGLU, GeGLU).

All functions are pure jnp and shape-polymorphic over leading axes.  The arithmetic follows
transformers' order, so a bfloat16 model rounds where transformers rounds:

* RMSNorm: statistics and normalization in float32, cast to the input dtype, then multiplied by the
  gain in that dtype (``weight * x_normed.to(input_dtype)``); Gemma's RMSNorm (``offset=True``)
  instead multiplies the float32 normalized values by ``1 + weight`` in float32 and casts the
  product once (``(x_normed * (1.0 + weight.float())).type_as(x)``);
* RoPE: angles ``position * inv_freq`` in float32, ``cos``/``sin`` (times the scaling's
  ``cos_sin_scale``) cast to the input dtype, then ``x * cos + rotate_half(x) * sin`` in that dtype;
* inverse frequencies: transformers' formulas in float32 (:func:`scaled_inv_freq`);
* SiLU: ``x / (1 + exp(-x))`` in float32, rounded once (torch's bfloat16 SiLU, :func:`silu`);
* GELU-tanh: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` in float32, rounded once (torch's
  ``gelu(approximate="tanh")`` on bfloat16, :func:`gelu_tanh`).

For a float32 model every cast is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import math

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv.ops.ffi.packed_weight import PackedWeight, unpack_bf16_weight

__all__ = [
    "rms_norm",
    "Products",
    "products",
    "PACKED_FASTEST_FORMS",
    "packed_products_fastest",
    "matmul_t",
    "matmul_t_many",
    "rope_frequencies",
    "scaled_inv_freq",
    "apply_rope",
    "token_positions",
    "gated_mlp",
    "silu",
    "gelu_tanh",
    "linear",
    "linear_many",
]

_F32 = jnp.float32


class Products(str, enum.Enum):
    """How :func:`matmul_t` computes the weight products of a traced step.

    * ``XLA``: XLA's own dots (every platform; see :func:`matmul_t` for the two spellings).
    * ``AUTO`` (CPU with the FFI library, bfloat16 ``x`` and ``w``): this CPU's fastest product per
      row count, from the table of :func:`packed_products_fastest`: where the FFI packed products
      are (AMX tiles or AVX512_BF16), the weights are packed once
      (:meth:`~ninfer_kv.models.decoder.steps.ModelSteps.prepare_params`) and a step traced over
      them runs ``AUTO`` as ``BATCH_INVARIANT`` (it costs nothing there); elsewhere the weights
      stay plain, the FFI row kernel (:func:`ninfer_kv.ops.ffi.products.matmul_bf16`) takes single-row
      products (a decode step at batch 1: it reads each weight once, front to back, faster than
      XLA's matrix-vector kernel) and XLA's dots take more rows.
    * ``BATCH_INVARIANT`` (CPU with the FFI library): every computation of a row depends on that
      row alone: bfloat16 weight products through the FFI packed products (packed weights) or row
      kernel (plain ones), :func:`rms_norm`'s sum of squares as a fixed pairwise tree (XLA's CPU
      reductions change their order with the number of rows), and the FFI attention's context
      splits at fixed key offsets (:func:`ninfer_kv.ops.ffi.handlers.fixed_splits`).

    Weights packed once (:func:`ninfer_kv.models.decoder.weights.pack_params`, a
    :class:`~ninfer_kv.ops.ffi.packed_weight.PackedWeight` in place of the array) take the FFI packed
    products (:func:`ninfer_kv.ops.ffi.products.matmul_bf16_packed`) under ``AUTO`` and ``BATCH_INVARIANT``
    at every row count.  Under ``XLA`` a packed weight is unpacked in the step and multiplied by
    XLA's dot.
    """

    AUTO = "auto"
    XLA = "xla"
    BATCH_INVARIANT = "batch_invariant"


PACKED_FASTEST_FORMS = ("amx-chunks", "amx-pairs", "vdpbf16ps")
"""The forms of the FFI packed products (:func:`ninfer_kv.ops.ffi.products.packed_kernel`) that are the
CPU's fastest weight products at every row count (see :func:`packed_products_fastest`)."""


def packed_products_fastest() -> bool:
    """Whether the FFI packed products are this CPU's fastest weight products at every row count,
    by the documented table (``bench/bench_products.py`` measures it on a machine; docs/MODELS.md
    gives the figures):

    ==========================  ===============  =================
    packed form                 one row          two rows and more
    ==========================  ===============  =================
    ``amx-*`` (AMX-BF16)        packed products  packed products
    ``vdpbf16ps`` (AVX512_BF16) packed products  packed products
    ``fma`` (every other CPU)   FFI row kernel   XLA's dots
    ==========================  ===============  =================

    ``False`` without the FFI library.  ``"auto"`` products follow it; ``"batch_invariant"`` takes
    the packed products everywhere (batch invariance at the ``fma`` form's speed)."""
    from ninfer_kv.ops.ffi import products as ffi_products
    from ninfer_kv.ops.ffi import handlers as ffi_handlers

    return ffi_handlers.is_available() and ffi_products.packed_kernel() in PACKED_FASTEST_FORMS


_PRODUCTS: contextvars.ContextVar[Products] = contextvars.ContextVar("ninfer_kv_products", default=Products.XLA)


@contextlib.contextmanager
def products(mode: Products | str):
    """Within the block, the layers compute as ``mode`` says (read when a step is traced)."""
    mode = Products(mode)
    token = _PRODUCTS.set(mode)
    try:
        if mode is Products.BATCH_INVARIANT:
            from ninfer_kv.ops.ffi import handlers as ffi_handlers

            with ffi_handlers.fixed_splits():
                yield
        else:
            yield
    finally:
        _PRODUCTS.reset(token)


def _tree_sum(v: jax.Array) -> jax.Array:
    """The sum over the last axis as a fixed pairwise tree (zero-padded to a power of two), keepdims."""
    n = v.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, width - n)])
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v


def rms_norm(x: jax.Array, gain: jax.Array, eps: float, *, offset: bool = False) -> jax.Array:
    """``(x / sqrt(mean(x^2) + eps)).astype(x.dtype) * gain`` over the last axis (statistics in float32).

    With ``offset`` (Gemma's RMSNorm): ``((x / sqrt(mean(x^2) + eps)) * (1 + gain)).astype(x.dtype)``,
    the gain and the product in float32, one rounding at the end.  Under
    :attr:`Products.BATCH_INVARIANT` the sum of squares is a fixed pairwise tree.
    """
    xf = x.astype(_F32)
    if _PRODUCTS.get() is Products.BATCH_INVARIANT:
        ms = _tree_sum(xf * xf) / _F32(x.shape[-1])
    else:
        ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(ms + _F32(eps))
    if offset:
        return ((xf * inv) * (_F32(1.0) + gain.astype(_F32))).astype(x.dtype)
    return (xf * inv).astype(x.dtype) * gain.astype(x.dtype)


def _default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """``1 / theta ** (2i / head_dim)`` in float32, transformers' operation order."""
    expo = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** expo)).astype(np.float32)


def scaled_inv_freq(head_dim: int, theta: float, scaling: "RopeScaling | None") -> np.ndarray:
    """float32 ``(head_dim / 2,)`` inverse frequencies of plain or scaled RoPE.

    ``linear``: ``inv / factor``.  ``llama3``: wavelengths ``2 pi / inv`` above
    ``original / low_freq_factor`` divided by ``factor``, below ``original / high_freq_factor``
    kept, and in between ``(1 - s) * inv / factor + s * inv`` with
    ``s = (original / wavelength - low) / (high - low)``.  ``yarn``: the ramp
    ``1 - clip((i - low) / (high - low), 0, 1)`` over ``i < head_dim / 2`` (``low``/``high`` the
    dimensions where ``beta_fast``/``beta_slow`` rotations fit the original context) blends
    ``inv`` (extrapolation) and ``inv / factor`` (interpolation).
    """
    inv = _default_inv_freq(head_dim, theta)
    if scaling is None:
        return inv
    f32 = np.float32
    if scaling.kind == "linear":
        return (inv / f32(scaling.factor)).astype(np.float32)
    if scaling.kind == "llama3":
        old = float(scaling.original_max_position_embeddings)
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = f32(2 * math.pi) / inv
        llama = np.where(wavelen > f32(low_wavelen), inv / f32(scaling.factor), inv).astype(np.float32)
        smooth = ((f32(old) / wavelen - f32(scaling.low_freq_factor))
                  / f32(scaling.high_freq_factor - scaling.low_freq_factor)).astype(np.float32)
        smoothed = ((f32(1) - smooth) * llama / f32(scaling.factor) + smooth * llama).astype(np.float32)
        medium = ~(wavelen < f32(high_wavelen)) & ~(wavelen > f32(low_wavelen))
        return np.where(medium, smoothed, llama).astype(np.float32)
    # yarn
    dim = head_dim
    orig = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = f32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / f32(dim))
    extrapolation = (f32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (f32(1.0) / (f32(scaling.factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - f32(low)) / f32(high - low), 0, 1).astype(np.float32)
    extra_factor = (f32(1) - ramp).astype(np.float32)
    return (interpolation * (f32(1) - extra_factor) + extrapolation * extra_factor).astype(np.float32)


def rope_frequencies(head_dim: int, theta: float, scaling: "RopeScaling | None" = None) -> jax.Array:
    """Inverse frequencies ``(head_dim / 2,)`` float32 (:func:`scaled_inv_freq` as a JAX array)."""
    return jnp.asarray(scaled_inv_freq(head_dim, theta, scaling))


def token_positions(start: jax.Array, length: int) -> jax.Array:
    """Absolute positions ``start[b] + t`` of a chunk: int32 ``(B,) -> (B, length)``."""
    return jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, scaling: "RopeScaling | None" = None) -> jax.Array:
    """Rotate ``x (B, T, heads, D)`` at integer ``positions (B, T)`` (half-split convention).

    Dimension ``i < D/2`` pairs with ``i + D/2``: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``
    with angle ``position * inv_freq[i]`` (:func:`scaled_inv_freq`); cos and sin are multiplied by
    the scaling's ``cos_sin_scale`` and cast to ``x.dtype`` before the products (transformers' order).
    """
    d = x.shape[-1]
    inv = rope_frequencies(d, theta, scaling)
    ang = positions.astype(_F32)[..., None] * inv  # (B, T, D/2)
    scale = 1.0 if scaling is None else scaling.cos_sin_scale
    cos = jnp.cos(ang)
    sin = jnp.sin(ang)
    if scale != 1.0:
        cos, sin = cos * _F32(scale), sin * _F32(scale)
    # transformers' form, x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1): the
    # concatenation is of the input, so XLA's CPU backend (which fuses no concatenation) makes one
    # pass for the rotation instead of one per half and a concatenation of the results
    cos = jnp.concatenate([cos, cos], axis=-1).astype(x.dtype)[:, :, None, :]
    sin = jnp.concatenate([sin, sin], axis=-1).astype(x.dtype)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def matmul_t(x: jax.Array, w) -> jax.Array:
    """``x @ w.T`` for ``w (out, in)``, accumulated and returned in float32.

    Under :func:`products` ``BATCH_INVARIANT`` (or ``AUTO`` with one row) with bfloat16 ``x`` and
    ``w``, the FFI row kernel (see :class:`Products`).  Otherwise XLA's dot, in one of two spellings chosen by the
    (static) number of rows of ``x``, because XLA's CPU compiler lowers them to different kernels:
    a matmul with the transposed weight takes its fast matrix-vector kernel for one row and is best
    again from a few hundred rows, while between those a ``dot_general`` contracting ``w``'s second
    axis is 3 to 8 times faster (bf16, 1024 x 3072 and 1024 x 19K weights measured on a 2-core
    Xeon).  On accelerators both lower to the same product.
    """
    rows = math.prod(x.shape[:-1])
    if _packed_kernel(x, w):
        from ninfer_kv.ops.ffi import products as ffi_products

        return ffi_products.matmul_bf16_packed(x, w)
    if isinstance(w, PackedWeight):
        w = unpack_bf16_weight(w)
    if _row_kernel(x, w):
        from ninfer_kv.ops.ffi import products as ffi_products

        return ffi_products.matmul_bf16(x, w)
    if rows == 1 or rows >= _MATVEC_FORM_FROM_ROWS:
        return jnp.matmul(x, w.T, preferred_element_type=jnp.float32)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def matmul_t_many(x: jax.Array, weights) -> tuple[jax.Array, ...]:
    """:func:`matmul_t` of one ``x`` with each of ``weights``; one FFI call for all of them where the
    row kernel or the packed products apply (bit-identical to one call per weight), else one product
    each."""
    if _packed_kernel(x, *weights):
        from ninfer_kv.ops.ffi import products as ffi_products

        return ffi_products.matmul_bf16_packed_many(x, weights)
    if _row_kernel(x, *weights):
        from ninfer_kv.ops.ffi import products as ffi_products

        return ffi_products.matmul_bf16_many(x, weights)
    return tuple(matmul_t(x, w) for w in weights)


def _packed_kernel(x: jax.Array, *weights) -> bool:
    """Whether the current :class:`Products` mode takes the FFI packed products for these operands."""
    return (_PRODUCTS.get() is not Products.XLA and x.dtype == jnp.bfloat16
            and all(isinstance(w, PackedWeight) for w in weights))


def _row_kernel(x: jax.Array, *weights) -> bool:
    """Whether the current :class:`Products` mode takes the FFI row kernel for these operands."""
    mode = _PRODUCTS.get()
    if any(isinstance(w, PackedWeight) for w in weights):
        return False
    if x.dtype != jnp.bfloat16 or any(w.dtype != jnp.bfloat16 for w in weights):
        return False
    return mode is Products.BATCH_INVARIANT or (mode is Products.AUTO and math.prod(x.shape[:-1]) == 1)


_MATVEC_FORM_FROM_ROWS = 256
"""From this many rows :func:`matmul_t` takes the transposed-weight form again (see there)."""


def linear_many(x: jax.Array, weights, biases) -> tuple[jax.Array, ...]:
    """:func:`linear` of one ``x`` with each ``(w, b)`` (``b`` may be ``None``), the products in one
    :func:`matmul_t_many` call.  Without biases the packed products round to ``x.dtype`` as they
    write (the same bits, without the float32 results)."""
    if _packed_kernel(x, *weights) and all(b is None for b in biases):
        from ninfer_kv.ops.ffi import products as ffi_products

        return ffi_products.matmul_bf16_packed_many(x, weights, out_dtype=x.dtype)
    out = []
    for y, b in zip(matmul_t_many(x, weights), biases):
        if b is not None:
            y = y + b.astype(jnp.float32)
        out.append(y.astype(x.dtype))
    return tuple(out)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """``x @ w.T (+ b)`` with ``w (out, in)`` (an ``nn.Linear`` weight), float32 accumulation, the bias
    added before the one rounding to ``x.dtype``."""
    return linear_many(x, (w,), (b,))[0]


def gated_mlp(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    b_gate: jax.Array | None = None,
    b_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    *,
    activation: str = "silu",
) -> jax.Array:
    """``down(act(gate(x)) * up(x))`` with :func:`linear` projections ``(out, in)`` (biases optional);
    ``act`` is :func:`silu` (``"silu"``: SwiGLU) or :func:`gelu_tanh` (``"gelu_tanh"``: GeGLU).
    The activation is rounded to ``x.dtype`` before the product with ``up(x)``, as transformers'
    MLPs round it."""
    acts = {"silu": silu, "gelu_tanh": gelu_tanh}
    if activation not in acts:
        raise ValueError(f"activation={activation!r} is not supported; allowed: {', '.join(acts)}")
    gate, up = linear_many(x, (w_gate, w_up), (b_gate, b_up))
    return linear(acts[activation](gate) * up, w_down, b_down)


def silu(x: jax.Array) -> jax.Array:
    """``x / (1 + exp(-x))`` in float32, rounded once to ``x.dtype`` (torch's SiLU on bfloat16).

    ``jax.nn.silu`` on bfloat16 rounds the sigmoid before the product: 37% of random bfloat16
    inputs then differ from torch by a bfloat16 step; this form matches torch's on all of them.
    """
    xf = x.astype(_F32)
    return (xf / (_F32(1.0) + jnp.exp(-xf))).astype(x.dtype)


_GELU_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5  # sqrt(2 / pi), torch's kBeta
_GELU_KAPPA = 0.044715
_TANH_FAR = 0.625
"""From this ``|y|`` on, :func:`_one_plus_tanh` derives ``tanh`` from ``exp(-2|y|)`` (there
``1 - |tanh(y)| <= 0.5``, so the float32 ``tanh`` lies on the ``2**-24`` grid)."""
_TANH_SATURATES = 8.664339742
"""Above this ``|y|`` torch's float32 ``tanh`` (SLEEF's) returns exactly ``+-1``."""


def _one_plus_tanh(y: jax.Array) -> jax.Array:
    """float32 ``1 + tanh(y)`` as torch computes it: ``tanh`` rounded to float32, then the sum rounded.

    XLA's CPU ``tanh`` is a fast approximation a few float32 steps off, which ``1 + tanh(y)``
    magnifies where ``tanh(y)`` is near ``-1``.  For ``|y| >= 0.625`` this takes
    ``v = 1 - tanh(|y|) = 2 e / (1 + e)`` with ``e = exp(-2|y|)`` (accurate relative to ``v``),
    rounds ``tanh(|y|) = 1 - v`` to its float32 grid of ``2**-24`` exactly, and forms the sum from it
    (``tanh`` is exactly ``+-1`` above ``8.664339742``, as torch's is); nearer zero it is ``1 + tanh(y)``.
    """
    a = jnp.abs(y)
    e = jnp.exp(_F32(-2.0) * a)
    steps = jnp.round((_F32(2.0) * e / (_F32(1.0) + e)) * _F32(2.0**24))  # 1 - tanh(|y|), in steps of 2**-24
    steps = jnp.where(a > _F32(_TANH_SATURATES), _F32(0.0), steps)
    far = jnp.where(y >= 0, _F32(1.0) + (_F32(1.0) - steps * _F32(2.0**-24)), steps * _F32(2.0**-24))
    return jnp.where(a >= _F32(_TANH_FAR), far, _F32(1.0) + jnp.tanh(y))


def gelu_tanh(x: jax.Array) -> jax.Array:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` in float32, rounded once to ``x.dtype``.

    torch's ``gelu(x, approximate="tanh")`` (transformers' ``gelu_pytorch_tanh``) computes a
    bfloat16 input in float32 in this order (``0.5 * x`` times ``1 + tanh(inner)``, ``inner`` from
    ``x * x * x``) and rounds once; this equals it on every normal bfloat16 input
    (:func:`_one_plus_tanh`), while ``jax.nn.gelu`` on bfloat16 rounds every intermediate.
    """
    xf = x.astype(_F32)
    inner = _F32(_GELU_BETA) * (xf + _F32(_GELU_KAPPA) * (xf * xf * xf))
    return ((_F32(0.5) * xf) * _one_plus_tanh(inner)).astype(x.dtype)
