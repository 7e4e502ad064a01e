"""Deterministic random weights of the example decoder.

Every tensor is drawn from its own numpy stream ``default_rng([seed, crc32(name)])``, so the
weights depend only on (config, seed) and a tensor's values do not change when other tensors are
added or removed.  Scales keep activations O(1) through depth:

* embedding ``N(0, 1)`` (RMSNorm follows every read of the residual);
* every projection ``N(0, 1 / fan_in)``, the residual-branch output projections (``wo``,
  ``w_down``) additionally scaled by ``1 / sqrt(2 * num_layers)`` so the residual stream stays O(1);
* norm gains ``1 + 0.1 * N(0, 1)`` (non-trivial, so a misapplied gain changes the result);
* LM head ``N(0, 4 / d_model)``: logits with a spread of a few units, so greedy decoding is
  decided by clear margins rather than near ties.

Parameter tree (plain dicts and tuples, a JAX pytree)::

    {"embed": (V, D), "layers": tuple of layer dicts, "final_norm": (D,), "lm_head": (D, V),
     "mtp": {...} (only when config.mtp)}

    layer = {"attn_norm": (D,), "wq": (D, Hq*Dh), "wk": (D, H*Dh), "wv": (D, H*Dh),
             "q_norm": (Dh,), "k_norm": (Dh,), "wo": (Hq*Dh, D),
             "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}

    mtp = {"enorm": (D,), "hnorm": (D,), "proj": (2D, D), "layer": layer, "final_norm": (D,)}

The MTP head shares ``embed`` and ``lm_head`` with the main model.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig

__all__ = ["init_params", "param_count", "layer_param_shapes"]


def layer_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's parameters."""
    d, f, dh = config.d_model, config.mlp_dim, config.head_dim
    hq, h = config.num_heads, config.num_kv_heads
    return {
        "attn_norm": (d,),
        "wq": (d, hq * dh),
        "wk": (d, h * dh),
        "wv": (d, h * dh),
        "q_norm": (dh,),
        "k_norm": (dh,),
        "wo": (hq * dh, d),
        "mlp_norm": (d,),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
    }


class _Init:
    def __init__(self, seed: int, config: ModelConfig):
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed={seed!r} is invalid; it must be an integer >= 0")
        self.seed = int(seed)
        self.config = config
        self.out_scale = 1.0 / np.sqrt(2.0 * config.num_layers)

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def normal(self, name: str, shape, std: float) -> jax.Array:
        x = self._rng(name).standard_normal(shape, dtype=np.float32) * np.float32(std)
        return jnp.asarray(x, self.config.jnp_dtype)

    def gain(self, name: str, shape) -> jax.Array:
        x = 1.0 + 0.1 * self._rng(name).standard_normal(shape, dtype=np.float32)
        return jnp.asarray(x, self.config.jnp_dtype)

    def layer(self, prefix: str) -> dict:
        out = {}
        for name, shape in layer_param_shapes(self.config).items():
            full = f"{prefix}.{name}"
            if name.endswith("norm"):
                out[name] = self.gain(full, shape)
            else:
                std = 1.0 / np.sqrt(shape[0])
                if name in ("wo", "w_down"):
                    std *= self.out_scale
                out[name] = self.normal(full, shape, std)
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
        "lm_head": init.normal("lm_head", (d, v), 2.0 / np.sqrt(d)),
    }
    if config.mtp:
        params["mtp"] = {
            "enorm": init.gain("mtp.enorm", (d,)),
            "hnorm": init.gain("mtp.hnorm", (d,)),
            "proj": init.normal("mtp.proj", (2 * d, d), 1.0 / np.sqrt(2 * d)),
            "layer": init.layer("mtp.layer"),
            "final_norm": init.gain("mtp.final_norm", (d,)),
        }
    return params


def param_count(params) -> int:
    """Total number of parameters in a parameter tree."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
