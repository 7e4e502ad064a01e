"""Tiny Hugging Face checkpoints written by the tests: ``config.json`` dicts of each family and option,
random tensors under transformers' names (shapes derived here from the config, not by the loader)."""

from __future__ import annotations

import json
import warnings
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


# -- tiny checkpoints written by transformers itself: the sliding-window and Gemma families --------------

WINDOW_COMMON = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.1,
                     rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=None)
"""The shape every :data:`WINDOW_FAMILIES` model shares (3 layers, so both layer types occur)."""

WINDOW_FAMILIES = {
    # alternating layers (sliding, full, sliding), a 48-token window, both soft caps small enough to bite
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=48, query_pre_attn_scalar=32, attn_logit_softcapping=1.0,
                    final_logit_softcapping=10.0, initializer_range=0.02)),
    # QK-norm, every 3rd layer full, the local RoPE (10000) and a linear-scaled global one (1e6, factor 8)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=48, sliding_window_pattern=3, query_pre_attn_scalar=32, final_logit_softcapping=10.0,
                    initializer_range=0.02,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})),
    # every layer slides over 80 tokens (more than a page)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=80)),
    # layers >= max_window_layers slide: layer 0 full, layers 1 and 2 over 80 tokens
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=80, max_window_layers=1)),
}
"""family -> (transformers config class, model class, config options) of the window oracle checkpoints."""


def save_transformers_checkpoint(family: str, directory: Path, *, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A tiny :data:`WINDOW_FAMILIES` checkpoint built and written by transformers (``save_pretrained``)
    in ``dtype`` (``"bfloat16"`` or ``"float32"``).

    Gemma's random initialization gives a tied head over a residual stream that its own token's scaled
    embedding dominates (every greedy token repeats the last one); so its norms are set to
    ``N(0, 0.1)`` (gains ``1 + w``), the final norm's gain to about 9 (logits of a few units, where the
    final soft cap bites) and the q/k projections scaled by 3 (scores of a few units, which a soft cap of 1 bites).
    """
    import torch
    import transformers

    conf_cls, model_cls, options = WINDOW_FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, conf_cls)(**{**WINDOW_COMMON, **options})
    model = getattr(transformers, model_cls)(config).eval()
    if family.startswith("gemma"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.1)
                if name == "model.norm.weight":
                    p.add_(8.0)
                if "q_proj" in name or "k_proj" in name:
                    p.mul_(3.0)
    model.to(getattr(torch, dtype)).save_pretrained(directory)
    return Path(directory)


def load_transformers_model(family: str, directory: Path, dtype: str = "bfloat16", attn_implementation: str = "eager"):
    """The checkpoint as users load it in transformers, with its eager attention by default (transformers'
    sdpa path silently drops Gemma 2's attention soft cap)."""
    import torch
    import transformers

    model_cls = getattr(transformers, WINDOW_FAMILIES[family][1])
    return model_cls.from_pretrained(directory, dtype=getattr(torch, dtype), attn_implementation=attn_implementation).eval()


# -- greedy tokens against an oracle's, up to reported near ties ------------------------------------------

BF16_TIE_ULPS = 2
"""A differing token is a near tie when the oracle's logits put the two within this many bfloat16 steps."""


def ulp_bf16(x: float) -> float:
    """The bfloat16 step at ``x``."""
    return 2.0 ** (np.floor(np.log2(max(abs(x), 1e-30))) - 7)


def compare_greedy(what: str, ours: list[int], ref: list[int], ref_logits: np.ndarray, tie=None, arbiter=None) -> int:
    """Tokens compared: all when equal; up to a reported near tie; fails at any other difference.

    ``ref_logits[i]`` are the oracle's logits that chose ``ref[i]``; ``tie(logit)`` is the largest
    margin that counts as a near tie (default: :data:`BF16_TIE_ULPS` bfloat16 steps of the oracle's
    logit).  ``arbiter(i)``, when given, returns the float32 oracle's logits at step ``i`` (after the
    common tokens ``ref[:i]``): a bfloat16 oracle rounds its scores and logits to bfloat16 (steps of
    0.03 at a logit of 4), so a difference its own logits call decisive is also accepted as a near tie
    when the float32 oracle puts the two tokens within the margin (or prefers ours).  After a near tie
    the sequences legitimately differ: the rest is not compared, and the tie is reported as a warning."""
    assert len(ours) == len(ref), (what, ours, ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        gap = float(ref_logits[i, b] - ref_logits[i, a])
        limit = tie(ref_logits[i, b]) if tie is not None else BF16_TIE_ULPS * ulp_bf16(ref_logits[i, b])
        judge = "the oracle"
        if gap > limit and arbiter is not None:
            exact = arbiter(i)
            gap, judge = float(exact[b] - exact[a]), "the float32 oracle"
        assert gap <= limit, (f"{what}: token {i} is {a}, the oracle chose {b} by a logit margin of {gap:.4f} "
                              f"per {judge} (a near tie is at most {limit:.4f})")
        # a plain UserWarning: pytest-xdist sends warnings to the controller, which cannot import a test module's class
        warnings.warn(f"near tie: {what}: token {i}: {a} vs the oracle's {b} (margin {gap:.4f} <= {limit:.4f} per "
                      f"{judge}); the rest of this sequence is not compared", UserWarning)
        return i
    return len(ref)


def float32_arbiter(model, prompt, ref):
    """``arbiter(i)`` for :func:`compare_greedy`: a float32 transformers ``model``'s logits after ``prompt``
    and ``ref[:i]``."""

    def logits_at(i: int) -> np.ndarray:
        import torch

        with torch.no_grad():
            return model(torch.tensor([list(prompt) + list(ref[:i])])).logits[0, -1].float().numpy()

    return logits_at
