"""``config.json`` files of published checkpoints, as their authors published them (the fields
that matter to the mapping; weights are not included).

For planning and trying a real size without downloading anything::

    from ninfer_kv.models.hf import model_config_from_hf, save_random_checkpoint
    from ninfer_kv.models.hf.published_configs import QWEN3_0_6B

    config, info = model_config_from_hf(QWEN3_0_6B)       # the decoder's ModelConfig
    save_random_checkpoint("qwen3-0.6b-random", QWEN3_0_6B, seed=0)   # random weights of that shape
"""

from __future__ import annotations

__all__ = ["QWEN3_0_6B", "LLAMA_3_2_1B", "QWEN2_5_0_5B", "MISTRAL_7B_V0_3", "LLAMA_2_7B", "GEMMA_2_2B", "GEMMA_3_1B_IT",
           "PUBLISHED"]

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
MISTRAL_7B_V0_3 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32768,
}
LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "tie_word_embeddings": False, "vocab_size": 32000,
}
GEMMA_2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "use_cache": True, "vocab_size": 256000,
}
GEMMA_3_1B_IT = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262144,
}

PUBLISHED = {
    "Qwen/Qwen3-0.6B": QWEN3_0_6B,
    "meta-llama/Llama-3.2-1B": LLAMA_3_2_1B,
    "Qwen/Qwen2.5-0.5B": QWEN2_5_0_5B,
    "mistralai/Mistral-7B-v0.3": MISTRAL_7B_V0_3,
    "meta-llama/Llama-2-7b-hf": LLAMA_2_7B,
    "google/gemma-2-2b": GEMMA_2_2B,
    "google/gemma-3-1b-it": GEMMA_3_1B_IT,
}
"""Repository name -> its ``config.json``."""
