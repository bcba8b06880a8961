"""The DSV4 model: parameters named as in HF transformers (without the `model.` prefix) and a forward
made of plain torch plus `torch.ops.dsv4rt.*` (through the `dsv4rt.ops` wrappers).

The forward reads the step inputs (fixed-size buffers filled by prepare), the caches and the weights.
It allocates only its own temporaries and never branches on tensor values.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv4rt.ops import attention, compressor, indexer, mhc, moe, swa
from dsv4rt.ops.kv_quant import QUANT_NONE
from dsv4rt.ops.norm import (head_norm_rope, idx_fp4_hadamard_fake_quant, kv_norm_rope_quant, rms_norm,
                             rope_rotate)
from dsv4rt.ops.rope import rope_table

from .cache import KVCache, LayerCache
from .config import CSA, HASH_MOE, SLIDING, ModelConfig


class StepTensors(NamedTuple):
    """Views of the static step-input buffers for one bucket (see prepare.StepInputs)."""
    token_ids: Tensor    # [T] int64
    positions: Tensor    # [T] int32
    req_slot: Tensor     # [T] int32, PAD_SLOT (-1) for padding
    start_pos: Tensor    # [T] int32, first position of the token's request in this step
    end_pos: Tensor      # [T] int32, one past the last position of the token's request in this step
    block_table: Tensor  # [S+1, MB] int32
    logit_rows: Tensor   # [R] int64, token rows whose logits are returned


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)


class Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=torch.float32)


def fp32_proj_dtype(dtype: torch.dtype) -> torch.dtype:
    """The weight dtype of a projection the reference runs in fp32 (the compressors', the indexer scorer's, the
    router's): a bf16 model keeps the checkpoint's bf16 (exact; half the bytes a step reads), others fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def project(x: Tensor, *weights: Tensor, gemv_tokens: int = 8) -> list[Tensor]:
    """x @ w.T for each weight, in x's dtype. Up to `gemv_tokens` tokens (decode): one `moe.linear` call, a GEMV launch
    over all the weights' rows; more tokens: cuBLAS a weight. On an H200 (graph-replayed, us; `linear` / cuBLAS): one
    token, q_a with kv 6.0 / 14.7, q_b with the indexer's q_b 22.4 / 25.4, o_b 21.3 / 22.2, the LM head 235 / 247;
    eight tokens (the tensor-core GEMV) 6.6 / 15.1, 23.4 / 25.9, 21.5 / 22.5, and the LM head 273 / 248, so the LM head
    passes `gemv_tokens=1`."""
    if x.shape[0] <= gemv_tokens:  # a static shape (one graph a bucket), not a data-dependent branch
        return moe.linear(x, *weights)
    return [F.linear(x, w) for w in weights]


class Compressor(nn.Module):
    """Projections and parameters of one compressor (run in fp32, as the official reference runs them)."""

    def __init__(self, cfg: ModelConfig, ratio: int, width: int, overlap: bool, dtype: torch.dtype) -> None:
        super().__init__()
        c = 2 if overlap else 1
        self.ratio, self.width, self.overlap = ratio, width, overlap
        self.kv_proj = Linear(c * width, cfg.hidden_size, fp32_proj_dtype(dtype))
        self.gate_proj = Linear(c * width, cfg.hidden_size, fp32_proj_dtype(dtype))
        self.position_bias = _param(ratio, c * width, dtype=torch.float32)
        self.kv_norm = Norm(width)

    def proj_weights(self) -> tuple[Tensor, Tensor]:
        """The weights of the step's (kv, score) rows [T, c*d], computed in fp32 (`moe.linear_fp32`)."""
        return self.kv_proj.weight, self.gate_proj.weight

    def update(self, kv: Tensor, score: Tensor, st: StepTensors, inv_freq: Tensor, kv_state: Tensor,
               score_state: Tensor, entries: Tensor, quant: int, eps: float, dtype: torch.dtype) -> None:
        compressor.compressor_update(kv, score, self.position_bias, self.kv_norm.weight, inv_freq, kv_state,
                                     score_state, entries, st.req_slot, st.positions, st.start_pos, st.end_pos,
                                     st.block_table, self.ratio, self.overlap, quant, eps, dtype)


class Scorer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.weights_proj = Linear(cfg.index_heads, cfg.hidden_size, fp32_proj_dtype(dtype))


class Indexer(Compressor):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, cfg.csa_ratio, cfg.index_head_dim, overlap=True, dtype=dtype)
        self.q_b_proj = Linear(cfg.index_heads * cfg.index_head_dim, cfg.q_lora_rank, dtype)
        self.scorer = Scorer(cfg, dtype)
        self.n_heads, self.head_dim, self.topk = cfg.index_heads, cfg.index_head_dim, cfg.index_topk


class MainCompressor(Compressor):
    def __init__(self, cfg: ModelConfig, layer_type: str, dtype: torch.dtype) -> None:
        super().__init__(cfg, cfg.ratio(layer_type), cfg.head_dim, overlap=layer_type == CSA, dtype=dtype)
        if layer_type == CSA:
            self.indexer = Indexer(cfg, dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.layer_type = cfg, layer_type
        h, hd = cfg.num_heads, cfg.head_dim
        self.q_a_proj = Linear(cfg.q_lora_rank, cfg.hidden_size, dtype)
        self.q_a_norm = Norm(cfg.q_lora_rank)
        self.q_b_proj = Linear(h * hd, cfg.q_lora_rank, dtype)
        self.kv_proj = Linear(hd, cfg.hidden_size, dtype)
        self.kv_norm = Norm(hd)
        self.o_a_proj = Linear(cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups, dtype)
        self.o_b_proj = Linear(cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.sinks = _param(h, dtype=torch.float32)
        if layer_type != SLIDING:
            self.compressor = MainCompressor(cfg, layer_type, dtype)

    def forward(self, x: Tensor, st: StepTensors, lc: LayerCache, inv_freq: Tensor,
                rot: tuple[Tensor, Tensor]) -> Tensor:
        """rot: the step's `rope_table(st.positions, inv_freq)`."""
        cfg = self.cfg
        n_tok, eps, rd = x.shape[0], cfg.norm_eps, cfg.rope_dim
        # the projections of one input share a launch at decode up to 8 tokens (`project`)
        qa, kv = project(x, self.q_a_proj.weight, self.kv_proj.weight)
        qr = rms_norm(qa, self.q_a_norm.weight, eps)
        if self.layer_type == CSA:  # the indexer's query projection reads qr too
            q, qi = project(qr, self.q_b_proj.weight, self.compressor.indexer.q_b_proj.weight)
        else:
            (q,) = project(qr, self.q_b_proj.weight)
        q = head_norm_rope(q.view(n_tok, cfg.num_heads, cfg.head_dim), *rot, eps)  # per-head RMSNorm, then RoPE
        # norm, RoPE and, with FP8 caches, the row's FP8 fake quant (official numerics: the kv row is FP8 from here on)
        kv = kv_norm_rope_quant(kv, self.kv_norm.weight, *rot, eps, lc.main_quant != QUANT_NONE)

        entries, entry_idx, ratio = None, None, 1
        if self.layer_type != SLIDING:
            comp = self.compressor
            entries, ratio = lc.entries, comp.ratio
            if self.layer_type != CSA:
                kv_m, sc_m = moe.linear_fp32(x, *comp.proj_weights())
                comp.update(kv_m, sc_m, st, inv_freq, lc.kv_state, lc.score_state, lc.entries, lc.main_quant, eps,
                            x.dtype)
            else:  # the main and indexer compressors in one op (one launch at decode)
                ix = comp.indexer
                # the layer's five fp32-result projections of x: one launch at decode
                kv_m, sc_m, kv_i, sc_i, w = moe.linear_fp32(x, *comp.proj_weights(), *ix.proj_weights(),
                                                            ix.scorer.weights_proj.weight)
                compressor.compressor_update_pair(
                    kv_m, sc_m, comp.position_bias, comp.kv_norm.weight, lc.kv_state, lc.score_state, lc.entries,
                    lc.main_quant, kv_i, sc_i, ix.position_bias, ix.kv_norm.weight, lc.idx_kv_state,
                    lc.idx_score_state, lc.idx_entries, lc.idx_quant, inv_freq, st.req_slot, st.positions,
                    st.start_pos, st.end_pos, st.block_table, comp.ratio, comp.overlap, eps, x.dtype)
                qi = rope_rotate(qi.view(n_tok, ix.n_heads, ix.head_dim), *rot)
                if lc.idx_quant != QUANT_NONE:  # official: Hadamard + FP4 on the indexer query too
                    qi = idx_fp4_hadamard_fake_quant(qi)
                w = w * (ix.n_heads**-0.5 * ix.head_dim**-0.5)
                entry_idx = indexer.indexer_topk(qi, w, lc.idx_entries, st.req_slot, st.positions, st.block_table,
                                                 ratio, ix.topk)

        o = attention.sparse_attn(q, kv, lc.swa, entries, entry_idx, self.sinks, st.req_slot, st.positions,
                                  st.start_pos, st.block_table, ratio, rd, cfg.head_dim**-0.5)
        swa.swa_cache_write(kv, lc.swa, st.req_slot, st.positions, st.end_pos, rd)
        o = rope_rotate(o, *rot, inverse=True)
        # grouped output projection: group g of z from group g of the heads and rows [g*r, (g+1)*r) of o_a_proj. A
        # batched cuBLAS GEMM at every size: at one token it took 18.5 us, `moe.linear(..., groups=g)` 22.5 (H200)
        g = cfg.o_groups
        w_a = self.o_a_proj.weight.view(g, cfg.o_lora_rank, -1)
        z = torch.einsum("tgi,goi->tgo", o.reshape(n_tok, g, -1), w_a).reshape(n_tok, g * cfg.o_lora_rank)
        (out,) = project(z, self.o_b_proj.weight)
        return out


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, is_hash: bool, dtype: torch.dtype) -> None:
        super().__init__()
        # the router runs in fp32 (moe_gate casts); the weight as fp32_proj_dtype says
        self.weight = _param(cfg.n_experts, cfg.hidden_size, dtype=fp32_proj_dtype(dtype))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.n_active, dtype=torch.int64))
        else:
            self.e_score_correction_bias = _param(cfg.n_experts, dtype=torch.float32)


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = _param(cfg.n_experts, 2 * cfg.moe_inter, cfg.hidden_size, dtype=dtype)
        self.down_proj = _param(cfg.n_experts, cfg.hidden_size, cfg.moe_inter, dtype=dtype)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.moe_inter, cfg.hidden_size, dtype)
        self.up_proj = Linear(cfg.moe_inter, cfg.hidden_size, dtype)
        self.down_proj = Linear(cfg.hidden_size, cfg.moe_inter, dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.is_hash = cfg, mlp_type == HASH_MOE
        self.gate = Gate(cfg, self.is_hash, dtype)
        self.experts = Experts(cfg, dtype)
        self.shared_experts = SharedExpert(cfg, dtype)

    def forward(self, x: Tensor, token_ids: Tensor) -> Tensor:
        cfg = self.cfg
        logits = moe.moe_gate(x, self.gate.weight)
        if self.is_hash:
            weights, ids = moe.moe_hash_route(logits, self.gate.tid2eid, token_ids, cfg.routed_scale)
        else:
            weights, ids = moe.moe_route(logits, self.gate.e_score_correction_bias, cfg.n_active, cfg.routed_scale)
        se = self.shared_experts  # read in place by the same op: no concatenated copy of its weights
        # x_ready: x was written before the router kernels above, so the shared expert may start while they finish
        return moe.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, cfg.swiglu_limit,
                               se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, x_ready=True)


class HyperConnection(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.fn = _param((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32)
        self.base = _param((2 + n) * n, dtype=torch.float32)
        self.scale = _param(3, dtype=torch.float32)


class HyperHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.hc_fn = _param(n, n * cfg.hidden_size, dtype=torch.float32)
        self.hc_base = _param(n, dtype=torch.float32)
        self.hc_scale = _param(1, dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.layer_type = cfg, cfg.layer_types[idx]
        self.self_attn = Attention(cfg, self.layer_type, dtype)
        self.mlp = MoE(cfg, cfg.mlp_types[idx], dtype)
        self.input_layernorm = Norm(cfg.hidden_size)
        self.post_attention_layernorm = Norm(cfg.hidden_size)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    # The hyper-connection boundaries: each hc_pre returns its collapsed row already through the sublayer's RMSNorm
    # (one launch, not two), and the hc_post that ends a sublayer runs with the next sublayer's hc_pre as one op
    # (hc_post_pre), across blocks too: Model.forward hands each block its attention input and the next block.
    def pre(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The attention sublayer's hc_pre of `streams` (the first block's; later blocks get theirs from post_pre)."""
        cfg, hc = self.cfg, self.attn_hc
        return mhc.hc_pre(streams, hc.fn, hc.base, hc.scale, cfg.hc_iters, cfg.hc_eps, cfg.norm_eps,
                          self.input_layernorm.weight, cfg.norm_eps)

    def post_pre(self, streams: Tensor, y: Tensor, post: Tensor, comb: Tensor,
                 attn: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """hc_post of the sublayer before (output y), then this block's attention (attn) or MoE sublayer's hc_pre."""
        cfg = self.cfg
        hc, norm = (self.attn_hc, self.input_layernorm) if attn else (self.ffn_hc, self.post_attention_layernorm)
        return mhc.hc_post_pre(streams, y, post, comb, hc.fn, hc.base, hc.scale, cfg.hc_iters, cfg.hc_eps,
                               cfg.norm_eps, norm.weight, cfg.norm_eps)

    def forward(self, streams: Tensor, x: Tensor, post: Tensor, comb: Tensor, st: StepTensors, lc: LayerCache,
                inv_freq: Tensor, rot: tuple[Tensor, Tensor],
                nxt: Optional["Block"]) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """(x, post, comb) = this block's attention hc_pre of `streams`. Returns the next block's (streams, x, post,
        comb); the last block (nxt None) returns (streams after its final hc_post, None, None, None)."""
        y = self.self_attn(x, st, lc, inv_freq, rot)
        streams, x, post, comb = self.post_pre(streams, y, post, comb, attn=False)
        y = self.mlp(x, st.token_ids)
        if nxt is None:
            return mhc.hc_post(streams, y, post, comb), None, None, None
        return nxt.post_pre(streams, y, post, comb, attn=True)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(vocab, dim, dtype=dtype)


class Model(nn.Module):
    """DSV4 causal LM. Construct with `from_pretrained` (checkpoint.py), `from_hf_state_dict` or `random`
    (weights.py)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(Block(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size)
        self.hc_head = HyperHead(cfg)
        self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, dtype)
        self.register_buffer("inv_freq_main", cfg.inv_freq(SLIDING), persistent=False)
        self.register_buffer("inv_freq_compress", cfg.inv_freq(CSA), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, st: StepTensors, cache: KVCache) -> Tensor:
        """One step over the bucket's tokens. Returns fp32 logits [R, V] of the rows `st.logit_rows`."""
        cfg = self.cfg
        x = F.embedding(st.token_ids, self.embed_tokens.weight)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        tables: dict[bool, tuple[Tensor, Tensor]] = {}  # the step's RoPE tables (main, compress): one each
        layers = list(self.layers)
        x, post, comb = layers[0].pre(streams)
        for i, (layer, lc) in enumerate(zip(layers, cache.layers)):
            sliding = layer.layer_type == SLIDING
            inv_freq = self.inv_freq_main if sliding else self.inv_freq_compress
            if sliding not in tables:
                tables[sliding] = rope_table(st.positions, inv_freq)
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            streams, x, post, comb = layer(streams, x, post, comb, st, lc, inv_freq, tables[sliding], nxt)
        h = self.hc_head
        x = mhc.hc_head(streams, h.hc_fn, h.hc_base, h.hc_scale, cfg.hc_eps, cfg.norm_eps, self.norm.weight,
                        cfg.norm_eps)
        (logits,) = project(x[st.logit_rows], self.lm_head.weight, gemv_tokens=1)
        return logits.float()

    # --------------------------------------------------------------- construction
    @classmethod
    def from_hf_state_dict(cls, cfg: ModelConfig, state_dict: dict, dtype: torch.dtype = torch.float32,
                           device: torch.device | str = "cpu") -> "Model":
        from .weights import load_hf_state_dict
        return load_hf_state_dict(cls, cfg, state_dict, dtype, device)

    @classmethod
    def from_pretrained(cls, path, layers: "int | range | None" = None, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu", progress: bool = True) -> "Model":
        """Load a checkpoint folder: official DeepSeek-V4 safetensors (FP8/FP4, decoded to `dtype`) or HF format.

        `layers=k` or `range(k)` keeps the first k blocks (plus embedding, head and norms). Every header is checked
        against config.json before weights are read; a bad folder raises `dsv4rt.CheckpointError` naming the
        file and the tensor. Progress goes to stderr, one line per shard.
        """
        from .checkpoint import load
        from .weights import check_device, check_dtype
        check_dtype(dtype)  # before a header is read
        return load(cls, path, layers=layers, dtype=dtype, device=check_device(device), progress=progress)

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> "Model":
        from .weights import init_random
        return init_random(cls, cfg, seed, dtype, device)

