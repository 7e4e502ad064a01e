"""Tiny Hugging Face checkpoints written by the tests: ``config.json`` dicts of each family and option,
random tensors under transformers' names (shapes derived here from the config, not by the loader)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from ninfer_kv.models.hf import write_safetensors

NP_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}

BASE = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096)

FAMILY_CONFIGS = {
    # Qwen3: QK-norm, tied embeddings, attention_bias (q, k, v, o), YaRN as Qwen3 documents it
    "qwen3": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True,
                  attention_bias=True, rope_theta=1000000.0,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                  eos_token_id=3),
    # Qwen2.5: q/k/v biases, linear RoPE scaling (the old "type" key)
    "qwen2": dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=False,
                  rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0}, use_sliding_window=False,
                  sliding_window=32768, max_window_layers=1),
    # Llama 3.1: llama3 RoPE, mlp_bias, no head_dim key (derived), 8 query heads over 2 KV heads
    "llama": {**{k: v for k, v in BASE.items() if k != "head_dim"}, "num_attention_heads": 2,
              "architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False,
              "mlp_bias": True, "attention_bias": False, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}},
    # Mistral: dense, full attention (sliding_window null), transformers 5's rope_parameters form
    "mistral": dict(BASE, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, num_key_value_heads=1),
}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """transformers tensor names and shapes of ``cfg``."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq = cfg["num_attention_heads"]
    hk = cfg.get("num_key_value_heads", hq)
    dh = cfg.get("head_dim") or d // hq
    fam = cfg["model_type"]
    attn_bias = cfg.get("attention_bias", False)
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (hq * dh, d), p + "self_attn.k_proj.weight": (hk * dh, d),
                    p + "self_attn.v_proj.weight": (hk * dh, d), p + "self_attn.o_proj.weight": (d, hq * dh),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)})
        if fam == "qwen3":
            out.update({p + "self_attn.q_norm.weight": (dh,), p + "self_attn.k_norm.weight": (dh,)})
        if fam == "qwen2" or attn_bias:
            out.update({p + "self_attn.q_proj.bias": (hq * dh,), p + "self_attn.k_proj.bias": (hk * dh,),
                        p + "self_attn.v_proj.bias": (hk * dh,)})
        if attn_bias and fam != "qwen2":
            out[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.get("mlp_bias", False):
            out.update({p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,), p + "mlp.down_proj.bias": (d,)})
    return out


def random_tensors(cfg: dict, seed: int = 0, dtype: str = "F32") -> dict[str, np.ndarray]:
    """Random tensors with O(1) activations and logits spread over a few units."""
    rng = np.random.default_rng(seed)
    d = cfg["hidden_size"]
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            x = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            x = rng.standard_normal(shape) * (2 / np.sqrt(d) if cfg.get("tie_word_embeddings") else 1.0)
        elif name == "lm_head.weight":
            x = rng.standard_normal(shape) * 2 / np.sqrt(d)
        else:
            x = rng.standard_normal(shape) / np.sqrt(shape[1])
            if "o_proj" in name or "down_proj" in name:
                x /= 2
        out[name] = x.astype(np.float32).astype(NP_DTYPES[dtype])
    return out


def write_checkpoint(directory: Path, cfg: dict, tensors: dict, *, shards: int = 1, generation_config=None) -> Path:
    """``config.json`` + ``model.safetensors`` (or ``shards`` files and an index) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    names = sorted(tensors)
    if shards == 1:
        write_safetensors(directory / "model.safetensors", tensors)
        return directory
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        write_safetensors(directory / fname, {n: tensors[n] for n in part})
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory
