"""The Hugging Face DeepseekV4 oracle: a tiny HF model with every parameter randomised, and helpers to run it."""
from __future__ import annotations

import torch

import dsv4rt
from dsv4rt.config import CSA, HASH_MOE, HCA, SLIDING

_HF_LAYER = {SLIDING: "sliding_attention", CSA: "compressed_sparse_attention", HCA: "heavily_compressed_attention"}
_HF_MLP = {HASH_MOE: "hash_moe", "moe": "moe"}


def hf_config(cfg: dsv4rt.ModelConfig):
    from transformers import DeepseekV4Config

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
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    )
    hc._attn_implementation = "eager"
    return hc


def hf_model(cfg: dsv4rt.ModelConfig, seed: int = 0):
    """A float32 HF DeepseekV4ForCausalLM whose weights (sinks, biases, tid2eid, mHC, ape included) are random."""
    from transformers import DeepseekV4ForCausalLM

    ours = dsv4rt.Model.random(cfg, seed=seed)
    hf = DeepseekV4ForCausalLM(hf_config(cfg)).eval()
    sd = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all("rotary_emb" in k for k in missing), missing
    return hf


@torch.no_grad()
def hf_run(hf, chunks: list[list[int]]) -> torch.Tensor:
    """Feed one request's chunks through HF with a cache; returns fp32 logits [sum(len), V]."""
    from transformers import DynamicCache

    past = DynamicCache(config=hf.config)
    outs = []
    for ch in chunks:
        out = hf(input_ids=torch.tensor([ch]), past_key_values=past, use_cache=True)
        outs.append(out.logits[0].float())
    return torch.cat(outs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())
