"""An independent float32/float64 numpy forward of a Hugging Face decoder checkpoint.

It reads the transformers-named tensors and the ``config.json`` dict directly (no ninfer_kv code):
embedding, per layer RMSNorm -> q/k/v projections (+ biases) -> optional per-head QK RMSNorm -> RoPE
(plain, linear, llama3 or yarn, computed in float64 from the formulas transformers documents) ->
causal GQA attention over K/V rounded to bfloat16 (what the BF16 profile stores) -> output projection
-> residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm and the (possibly tied) LM head.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def inv_freq(cfg: dict, dim: int) -> tuple[np.ndarray, float]:
    """float64 inverse frequencies and the cos/sin multiplier of ``cfg``'s RoPE."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    base = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return base, 1.0
    factor = rp["factor"]
    if kind == "linear":
        return base / factor, 1.0
    if kind == "llama3":
        old = rp["original_max_position_embeddings"]
        lo, hi = rp["low_freq_factor"], rp["high_freq_factor"]
        out = []
        for f in base:
            wl = 2 * math.pi / f
            if wl < old / hi:
                out.append(f)
            elif wl > old / lo:
                out.append(f / factor)
            else:
                s = (old / wl - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
        return np.array(out), 1.0
    assert kind == "yarn", kind
    orig = rp["original_max_position_embeddings"]
    beta_fast, beta_slow = rp.get("beta_fast", 32), rp.get("beta_slow", 1)

    def cdim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(cdim(beta_fast)), 0), min(math.ceil(cdim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    freq = base / factor * (1 - extra) + base * extra
    scale = rp.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return freq, scale


def forward(tensors: dict, cfg: dict, tokens, *, kv_bf16: bool = True) -> np.ndarray:
    """float32 logits ``(S, V)`` of ``tokens`` from position 0."""
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    d = cfg["hidden_size"]
    hq = cfg["num_attention_heads"]
    hk = cfg.get("num_key_value_heads", hq)
    dh = cfg.get("head_dim") or d // hq
    eps = cfg.get("rms_norm_eps", 1e-6)
    family = cfg["model_type"]
    tokens = np.asarray(tokens)
    s = tokens.shape[0]
    freq, scale = inv_freq(cfg, dh)
    ang = np.arange(s)[:, None] * freq[None, :]
    cos, sin = np.cos(ang) * scale, np.sin(ang) * scale

    def rope(x):  # (S, H, Dh)
        x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
        c, n = cos[:, None, :], sin[:, None, :]
        return np.concatenate([x1 * c - x2 * n, x2 * c + x1 * n], axis=-1)

    def lin(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    h = t["model.embed_tokens.weight"][tokens]
    mask = np.tril(np.ones((s, s), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, t[p + "input_layernorm.weight"], eps)
        q = lin(x, p + "self_attn.q_proj").reshape(s, hq, dh)
        k = lin(x, p + "self_attn.k_proj").reshape(s, hk, dh)
        v = lin(x, p + "self_attn.v_proj").reshape(s, hk, dh)
        if family == "qwen3":
            q = _rms(q, t[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, t[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q), rope(k)
        if kv_bf16:
            k = k.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
            v = v.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        g = hq // hk
        out = np.zeros((s, hq, dh))
        for head in range(hq):
            sc = q[:, head] @ k[:, head // g].T / math.sqrt(dh)
            sc = np.where(mask, sc, -np.inf)
            w = np.exp(sc - sc.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, head] = w @ v[:, head // g]
        h = h + lin(out.reshape(s, hq * dh), p + "self_attn.o_proj")
        x = _rms(h, t[p + "post_attention_layernorm.weight"], eps)
        gate = lin(x, p + "mlp.gate_proj")
        h = h + lin(gate / (1 + np.exp(-gate)) * lin(x, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = _rms(h, t["model.norm.weight"], eps)
    head = t["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else t["lm_head.weight"]
    return (x @ head.T).astype(np.float32)
