"""The Hugging Face DeepseekV4 oracle: a tiny HF model with every parameter randomised, and helpers to run it."""
from __future__ import annotations

import torch

import dsv4rt
from dsv4rt.hf import hf_config_for as hf_config
from dsv4rt.hf import hf_state_dict


def hf_model(cfg: dsv4rt.ModelConfig, seed: int = 0):
    """A float32 HF DeepseekV4ForCausalLM whose weights (sinks, biases, tid2eid, mHC, ape included) are random."""
    from transformers import DeepseekV4ForCausalLM

    ours = dsv4rt.Model.random(cfg, seed=seed)
    hf = DeepseekV4ForCausalLM(hf_config(cfg)).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(ours), strict=False)
    assert not unexpected, unexpected
    assert all("rotary_emb" in k for k in missing), missing
    return hf


@torch.no_grad()
def hf_run(hf, chunks: list[list[int]]) -> torch.Tensor:
    """Feed one request's chunks through HF with a cache; returns fp32 logits [sum(len), V]."""
    from transformers import DynamicCache

    past = DynamicCache(config=hf.config)
    device = hf.lm_head.weight.device
    outs = []
    for ch in chunks:
        out = hf(input_ids=torch.tensor([ch], device=device), past_key_values=past, use_cache=True)
        outs.append(out.logits[0].float().cpu())
    return torch.cat(outs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())
