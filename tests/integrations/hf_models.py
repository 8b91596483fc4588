"""Tiny transformers MoE models for the integration tests: built from config classes with
random init, nothing downloaded. Sizes: D = 64 (two MX blocks), F = 64, E = 8, k = 2."""

from __future__ import annotations

import torch
from torch import nn

D, F_EXPERT, E, K = 64, 64, 8, 2
VOCAB = 256


def _common(**kw) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=256, tie_word_embeddings=False, **kw)


def config(family: str):
    """A tiny config of ``family`` (qwen3_moe, mixtral, deepseek_v3, gpt_oss, jetmoe)."""
    import transformers as tf

    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_common(intermediate_size=128, moe_intermediate_size=F_EXPERT, num_experts=E,
                                           num_experts_per_tok=K, norm_topk_prob=True))
    if family == "mixtral":
        return tf.MixtralConfig(**_common(intermediate_size=F_EXPERT, num_local_experts=E, num_experts_per_tok=K))
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(vocab_size=VOCAB, hidden_size=D, intermediate_size=128, moe_intermediate_size=F_EXPERT,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E,
                                   num_experts_per_tok=K, n_shared_experts=1, n_group=2, topk_group=1,
                                   first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                                   qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    if family == "gpt_oss":
        return tf.GptOssConfig(**_common(intermediate_size=F_EXPERT, num_local_experts=E, num_experts_per_tok=K,
                                         sliding_window=32, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    if family == "jetmoe":  # MoE experts outside the ExpertsInterface: refused
        return tf.JetMoeConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_key_value_heads=2,
                               kv_channels=16, intermediate_size=F_EXPERT, num_local_experts=E, num_experts_per_tok=K,
                               max_position_embeddings=256)
    raise ValueError(family)


def causal_lm(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A randomly initialized tiny causal LM of ``family`` (eval mode off: training)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(family), dtype=dtype)


def moe_block(model: nn.Module) -> nn.Module:
    """The first MoE block of a model: the parent of its first experts module."""
    from mxmoe.integrations.transformers import is_experts_module

    return next(m for m in model.modules() if is_experts_module(getattr(m, "experts", None) or nn.Module()))
