"""Bridges to HF transformers DeepseekV4 (optional dependency): a config and a state dict for our weights."""
from __future__ import annotations

from .config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig

_HF_LAYER = {SLIDING: "sliding_attention", CSA: "compressed_sparse_attention", HCA: "heavily_compressed_attention"}
_HF_MLP = {HASH_MOE: "hash_moe", MOE: "moe"}


def hf_config_for(cfg: ModelConfig):
    """A transformers DeepseekV4Config describing the same model (YaRN passed explicitly when configured)."""
    from transformers import DeepseekV4Config

    rope = None
    if cfg.yarn is not None:
        rope = {"rope_type": "yarn", "factor": cfg.yarn.factor,
                "original_max_position_embeddings": cfg.yarn.original_max_position,
                "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow}
    hc = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_inter,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        sliding_window=cfg.sliding_window, index_n_heads=cfg.index_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.n_active,
        routed_scaling_factor=cfg.routed_scale, swiglu_limit=cfg.swiglu_limit,
        layer_types=[_HF_LAYER[t] for t in cfg.layer_types],
        compress_rates={"compressed_sparse_attention": cfg.csa_ratio, "heavily_compressed_attention": cfg.hca_ratio},
        mlp_layer_types=[_HF_MLP[t] for t in cfg.mlp_types], partial_rotary_factor=cfg.rope_dim / cfg.head_dim,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta, rope_parameters=rope,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_iters, hc_eps=cfg.hc_eps, rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_position,
    )
    hc._attn_implementation = "eager"
    return hc


def hf_state_dict(model) -> dict:
    """Our parameters under their HF names."""
    return {(k if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()}


def hf_model_for(model, device=None):
    """An HF DeepseekV4ForCausalLM holding the same weights (built directly on `device`)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    device = device or model.device
    with torch.device(device):
        hf = DeepseekV4ForCausalLM._from_config(hf_config_for(model.cfg), dtype=model.dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    if unexpected or any("rotary_emb" not in k for k in missing):
        raise ValueError(f"HF model does not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return hf.eval()
