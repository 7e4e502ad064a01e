"""Deterministic random weights of the decoder (checkpoints load through :mod:`ninfer_kv.models.hf`).

Every tensor is drawn from its own numpy stream ``default_rng([seed, crc32(name)])``, so the
weights depend only on (config, seed) and a tensor's values do not change when other tensors are
added or removed.  Scales keep activations O(1) through depth:

* embedding ``N(0, 1)`` (RMSNorm follows every read of the residual);
* every projection ``N(0, 1 / fan_in)``, the residual-branch output projections (``wo``,
  ``w_down``) additionally scaled by ``1 / sqrt(2 * num_layers)`` so the residual stream stays O(1);
* norm gains ``1 + 0.1 * N(0, 1)`` (non-trivial, so a misapplied gain changes the result); with
  ``gemma_norms`` the stored ``w`` is ``0.1 * N(0, 1)`` (the norm multiplies by ``1 + w``);
* LM head ``N(0, 4 / d_model)``: logits with a spread of a few units, so greedy decoding is
  decided by clear margins rather than near ties;
* biases (when the config has them) ``N(0, 0.1^2)``.

Parameter tree (plain dicts and tuples, a JAX pytree)::

    {"embed": (V, D), "layers": tuple of layer dicts, "final_norm": (D,), "lm_head": (V, D),
     "mtp": {...} (only when config.mtp)}

    layer = {"attn_norm": (D,), "wq": (Hq*Dh, D), "wk": (H*Dh, D), "wv": (H*Dh, D),
             "q_norm": (Dh,), "k_norm": (Dh,), "wo": (D, Hq*Dh),
             "mlp_norm": (D,), "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F)}
    (+ "bq": (Hq*Dh,), "bk", "bv": (H*Dh,) with qkv_bias; "bo": (D,) with o_bias;
     "b_gate", "b_up": (F,), "b_down": (D,) with mlp_bias; "post_attn_norm", "post_mlp_norm": (D,)
     with sandwich_norms; no q_norm/k_norm without qk_norm; no "lm_head" with tie_embeddings)

Projections and the LM head are stored ``(out, in)``, as a Hugging Face ``nn.Linear`` weight is (the
decoder contracts ``x`` with the ``in`` axis), so a checkpoint loads without a transposed copy.  The
random values are drawn in ``(in, out)`` order and transposed, so they equal those of the earlier
``(in, out)`` layout.

    mtp = {"enorm": (D,), "hnorm": (D,), "proj": (2D, D), "layer": layer, "final_norm": (D,)}

The MTP head shares ``embed`` and ``lm_head`` with the main model.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig

__all__ = ["init_params", "param_count", "param_shapes", "layer_param_shapes", "pack_params", "PROJECTIONS"]

PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
"""A layer's projection weights ``(out, in)``: what :func:`pack_params` packs."""


def layer_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's parameters (projections ``(out, in)``)."""
    d, f, dh = config.d_model, config.mlp_dim, config.head_dim
    hq, h = config.num_heads, config.num_kv_heads
    shapes = {
        "attn_norm": (d,),
        "wq": (hq * dh, d),
        "wk": (h * dh, d),
        "wv": (h * dh, d),
        "q_norm": (dh,),
        "k_norm": (dh,),
        "wo": (d, hq * dh),
        "mlp_norm": (d,),
        "w_gate": (f, d),
        "w_up": (f, d),
        "w_down": (d, f),
    }
    if not config.qk_norm:
        del shapes["q_norm"], shapes["k_norm"]
    if config.qkv_bias:
        shapes.update(bq=(hq * dh,), bk=(h * dh,), bv=(h * dh,))
    if config.o_bias:
        shapes["bo"] = (d,)
    if config.mlp_bias:
        shapes.update(b_gate=(f,), b_up=(f,), b_down=(d,))
    if config.sandwich_norms:
        shapes.update(post_attn_norm=(d,), post_mlp_norm=(d,))
    return shapes


class _Init:
    def __init__(self, seed: int, config: ModelConfig):
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed={seed!r} is invalid; it must be an integer >= 0")
        self.seed = int(seed)
        self.config = config
        self.out_scale = 1.0 / np.sqrt(2.0 * config.num_layers)

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def normal(self, name: str, shape, std: float, *, transposed: bool = False) -> jax.Array:
        """``N(0, std^2)`` of ``shape``; ``transposed`` draws the values in the reversed shape and
        transposes them (a projection ``(out, in)`` holds the values its ``(in, out)`` draw had)."""
        draw = tuple(reversed(shape)) if transposed else shape
        x = self._rng(name).standard_normal(draw, dtype=np.float32) * np.float32(std)
        if transposed:
            x = np.ascontiguousarray(x.T)
        return jnp.asarray(x, self.config.jnp_dtype)

    def gain(self, name: str, shape) -> jax.Array:
        x = 0.1 * self._rng(name).standard_normal(shape, dtype=np.float32)
        if not self.config.gemma_norms:  # Gemma's norms multiply by 1 + w
            x = 1.0 + x
        return jnp.asarray(x, self.config.jnp_dtype)

    def layer(self, prefix: str) -> dict:
        out = {}
        for name, shape in layer_param_shapes(self.config).items():
            full = f"{prefix}.{name}"
            if name.endswith("norm"):
                out[name] = self.gain(full, shape)
            elif name.startswith("b"):
                out[name] = self.normal(full, shape, 0.1)
            else:
                std = 1.0 / np.sqrt(shape[1])  # fan in
                if name in ("wo", "w_down"):
                    std *= self.out_scale
                out[name] = self.normal(full, shape, std, transposed=True)
        return out


def init_params(config: ModelConfig, seed: int = 0) -> dict:
    """Deterministic random parameters for ``config`` from ``seed`` (see the module docstring)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    init = _Init(seed, config)
    d, v = config.d_model, config.vocab_size
    params = {
        "embed": init.normal("embed", (v, d), 1.0),
        "layers": tuple(init.layer(f"layers.{i}") for i in range(config.num_layers)),
        "final_norm": init.gain("final_norm", (d,)),
    }
    if not config.tie_embeddings:
        params["lm_head"] = init.normal("lm_head", (v, d), 2.0 / np.sqrt(d), transposed=True)
    if config.mtp:
        params["mtp"] = {
            "enorm": init.gain("mtp.enorm", (d,)),
            "hnorm": init.gain("mtp.hnorm", (d,)),
            "proj": init.normal("mtp.proj", (2 * d, d), 1.0 / np.sqrt(2 * d)),
            "layer": init.layer("mtp.layer"),
            "final_norm": init.gain("mtp.final_norm", (d,)),
        }
    return params


def param_shapes(config: ModelConfig) -> dict:
    """The main model's parameter tree of ``config`` with ``jax.ShapeDtypeStruct`` leaves (nothing
    allocated; the MTP head, which no checkpoint carries, is left out)."""
    dt = config.jnp_dtype
    d, v = config.d_model, config.vocab_size
    layer = {k: jax.ShapeDtypeStruct(s, dt) for k, s in layer_param_shapes(config).items()}
    tree = {
        "embed": jax.ShapeDtypeStruct((v, d), dt),
        "layers": tuple(dict(layer) for _ in range(config.num_layers)),
        "final_norm": jax.ShapeDtypeStruct((d,), dt),
    }
    if not config.tie_embeddings:
        tree["lm_head"] = jax.ShapeDtypeStruct((v, d), dt)
    return tree


def pack_params(params: dict, config: ModelConfig) -> dict:
    """``params`` with its bfloat16 projections and LM head packed once for the FFI's packed products
    (:class:`~ninfer_kv.ops.ffi.packed_weight.PackedWeight`; :class:`~ninfer_kv.models.decoder.layers.Products`
    says when they are used).  A tied head gets its own packed copy as ``"lm_head"`` (the embedding
    table stays for the lookup); the MTP head and everything not bfloat16 stay as they are.  For
    the FFI backend on one CPU device only: the dense reference and the other backends take the
    plain params (under ``Products.XLA`` a packed weight is unpacked in every step).
    """
    from ninfer_kv.ops.ffi.packed_weight import PackedWeight, pack_bf16_weight

    def pack(w):
        if isinstance(w, PackedWeight) or getattr(w, "dtype", None) != jnp.bfloat16 or w.ndim != 2:
            return w
        return pack_bf16_weight(w)

    out = dict(params)
    out["layers"] = tuple({k: pack(v) if k in PROJECTIONS else v for k, v in lp.items()} for lp in params["layers"])
    head = params["embed"] if config.tie_embeddings and "lm_head" not in params else params["lm_head"]
    out["lm_head"] = pack(head)
    return out


def param_count(params) -> int:
    """Total number of parameters in a parameter tree."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
