"""Checkpoint folders: FP8/FP4 formats, official <-> HF names, round trips against HF, bad folders, CLI."""
import json
import os
import re
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dsv4rt
from dsv4rt import CheckpointError
from dsv4rt.checkpoint import INDEX_FILE, describe, expert_slot, local_name, official_name
from dsv4rt.checkpoint_writer import official_config, save_official, write_shards
from dsv4rt.config import HASH_MOE, MOE, ModelConfig
from dsv4rt.dequant import dequant_fp4, dequant_fp8_block, quant_fp4, quant_fp8_block
from oracle import hf_config, hf_model, hf_run, rel_err

TOL = 1e-4  # max |dlogit| <= TOL * max |logit|, as in test_parity
CFG = ModelConfig.tiny()  # S, C, H, C, H; hash MoE in layers 0-1; 8 experts of width 64
E8M0 = torch.float8_e8m0fnu


def e8m0(*exponents):
    return (torch.tensor(exponents, dtype=torch.int32) + 127).to(torch.uint8).view(E8M0)


def tokens(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def logits(model, seq):
    rt = dsv4rt.Runtime(model, max_requests=1, max_context=128)
    h = rt.admit()
    return rt.step({h: seq}, all_logits=True)[h]


def load(path, **kw):
    return dsv4rt.Model.from_pretrained(path, dtype=torch.float32, progress=False, **kw)


def assert_same_weights(ours, hf):
    """Every dsv4rt parameter equals HF's (exactly: both hold the same decoded values)."""
    theirs = {local_name(k): v for k, v in hf.state_dict().items() if local_name(k) is not None}
    mine = ours.state_dict()
    assert set(mine) == set(theirs)
    for k, v in mine.items():
        assert torch.equal(v, theirs[k].to(v.dtype)), k


# ---------------------------------------------------------------------------------------------- formats
def test_fp4_nibble_order_and_scales():
    packed = torch.zeros(2, 32, dtype=torch.uint8)  # [out 2, in 64 / 2]: two scale blocks per row
    packed[0, 0] = 0x2F    # low nibble 0xF = -6 (column 0), high 0x2 = 1.0 (column 1)
    packed[0, 1] = 0x71    # 0.5 (column 2), 6.0 (column 3)
    packed[0, 16] = 0x0B   # -1.5 (column 32, second block), 0 (column 33)
    packed[1, :] = 0x9A    # -1.0 (even columns), -0.5 (odd columns)
    scale = torch.stack([e8m0(1, -2), e8m0(-1, 0)])  # row 0: 2, 1/4; row 1: 1/2, 1
    w = dequant_fp4(packed.view(torch.int8), scale)
    assert w.shape == (2, 64)
    assert w[0, :4].tolist() == [-12.0, 2.0, 1.0, 12.0]
    assert w[0, 4:32].abs().sum() == 0
    assert w[0, 32:34].tolist() == [-0.375, 0.0]
    assert w[1, :4].tolist() == [-0.5, -0.25, -0.5, -0.25]
    assert w[1, 32:34].tolist() == [-1.0, -0.5]


def test_fp8_block_scale_layout():
    weight = torch.ones(200, 130).to(torch.float8_e4m3fn)  # partial blocks on both dims: scale [2, 2]
    scale = torch.stack([e8m0(0, 1), e8m0(2, -1)])
    w = dequant_fp8_block(weight, scale)
    assert w[0, 0] == 1 and w[127, 127] == 1       # block (0, 0)
    assert w[0, 128] == 2 and w[127, 129] == 2     # block (0, 1)
    assert w[128, 0] == 4 and w[199, 127] == 4     # block (1, 0)
    assert w[128, 128] == 0.5 and w[199, 129] == 0.5
    assert dequant_fp8_block(weight, scale, torch.bfloat16).dtype == torch.bfloat16


def test_fp8_quant_scales_hand_computed():
    w = torch.zeros(128, 384)
    w[5, 7] = 56.0       # amax 56 = 448 / 8 -> scale 2^-3 (byte 124), stored as 448
    w[0, 128] = -60.0    # amax 60 -> 2^ceil(log2(60/448)) = 2^-2 (byte 125), stored as -240
    q, s = quant_fp8_block(w)  # third block all zero -> smallest scale, byte 0
    assert q.dtype == torch.float8_e4m3fn and s.dtype == E8M0 and s.shape == (1, 3)
    assert s.view(torch.uint8).tolist() == [[124, 125, 0]]
    assert q[5, 7].float() == 448 and q[0, 128].float() == -240
    assert torch.equal(dequant_fp8_block(q, s), w)


def test_fp4_quant_hand_computed():
    row = torch.zeros(1, 32)
    row[0, :6] = torch.tensor([6.0, -6.0, 0.5, 0.24, 0.26, 5.1])  # amax 6 -> scale 1 (byte 127)
    packed, s = quant_fp4(row)
    assert s.view(torch.uint8).tolist() == [[127]]
    # codes 7, 15 | 1, 0 (0.24 rounds to 0) | 1 (0.26 -> 0.5), 7 (5.1 -> 6)
    assert packed.view(torch.uint8)[0, :3].tolist() == [0xF7, 0x01, 0x71]
    assert dequant_fp4(packed, s)[0, :6].tolist() == [6.0, -6.0, 0.5, 0.0, 0.5, 6.0]
    x = torch.randn(16, 64) * 3
    w = dequant_fp4(*quant_fp4(x))
    assert torch.equal(dequant_fp4(*quant_fp4(w)), w)  # decoded values are fixed points


# ---------------------------------------------------------------------------------------------- names
NAMES = [  # (official checkpoint name, dsv4rt / HF name), spec §11.6
    ("embed.weight", "embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "norm.weight"),
    ("hc_head_fn", "hc_head.hc_fn"),
    ("hc_head_base", "hc_head.hc_base"),
    ("hc_head_scale", "hc_head.hc_scale"),
    ("layers.0.attn_norm.weight", "layers.0.input_layernorm.weight"),
    ("layers.0.ffn_norm.weight", "layers.0.post_attention_layernorm.weight"),
    ("layers.0.hc_attn_fn", "layers.0.attn_hc.fn"),
    ("layers.0.hc_attn_base", "layers.0.attn_hc.base"),
    ("layers.0.hc_attn_scale", "layers.0.attn_hc.scale"),
    ("layers.4.hc_ffn_fn", "layers.4.ffn_hc.fn"),
    ("layers.4.hc_ffn_base", "layers.4.ffn_hc.base"),
    ("layers.4.hc_ffn_scale", "layers.4.ffn_hc.scale"),
    ("layers.1.attn.wq_a.weight", "layers.1.self_attn.q_a_proj.weight"),
    ("layers.1.attn.q_norm.weight", "layers.1.self_attn.q_a_norm.weight"),
    ("layers.1.attn.wq_b.weight", "layers.1.self_attn.q_b_proj.weight"),
    ("layers.1.attn.wkv.weight", "layers.1.self_attn.kv_proj.weight"),
    ("layers.1.attn.kv_norm.weight", "layers.1.self_attn.kv_norm.weight"),
    ("layers.1.attn.wo_a.weight", "layers.1.self_attn.o_a_proj.weight"),
    ("layers.1.attn.wo_b.weight", "layers.1.self_attn.o_b_proj.weight"),
    ("layers.1.attn.attn_sink", "layers.1.self_attn.sinks"),
    ("layers.2.attn.compressor.wkv.weight", "layers.2.self_attn.compressor.kv_proj.weight"),
    ("layers.2.attn.compressor.wgate.weight", "layers.2.self_attn.compressor.gate_proj.weight"),
    ("layers.2.attn.compressor.ape", "layers.2.self_attn.compressor.position_bias"),
    ("layers.2.attn.compressor.norm.weight", "layers.2.self_attn.compressor.kv_norm.weight"),
    ("layers.3.attn.indexer.wq_b.weight", "layers.3.self_attn.compressor.indexer.q_b_proj.weight"),
    ("layers.3.attn.indexer.weights_proj.weight", "layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("layers.3.attn.indexer.compressor.wkv.weight", "layers.3.self_attn.compressor.indexer.kv_proj.weight"),
    ("layers.3.attn.indexer.compressor.wgate.weight", "layers.3.self_attn.compressor.indexer.gate_proj.weight"),
    ("layers.3.attn.indexer.compressor.ape", "layers.3.self_attn.compressor.indexer.position_bias"),
    ("layers.3.attn.indexer.compressor.norm.weight", "layers.3.self_attn.compressor.indexer.kv_norm.weight"),
    ("layers.3.ffn.gate.weight", "layers.3.mlp.gate.weight"),
    ("layers.3.ffn.gate.bias", "layers.3.mlp.gate.e_score_correction_bias"),
    ("layers.0.ffn.gate.tid2eid", "layers.0.mlp.gate.tid2eid"),
    ("layers.3.ffn.shared_experts.w1.weight", "layers.3.mlp.shared_experts.gate_proj.weight"),
    ("layers.3.ffn.shared_experts.w2.weight", "layers.3.mlp.shared_experts.down_proj.weight"),
    ("layers.3.ffn.shared_experts.w3.weight", "layers.3.mlp.shared_experts.up_proj.weight"),
]


@pytest.mark.parametrize("official,local", NAMES)
def test_name_mapping(official, local):
    assert local_name(official) == local
    assert official_name(local) == official
    assert local_name(local) == local  # HF names pass through
    assert local_name("model." + local) == local


def test_hf_saved_and_ignored_names():
    # transformers' save_pretrained reverses its renames only partly
    assert local_name("model.layers.1.attn.norm.weight") == "layers.1.self_attn.kv_norm.weight"
    assert local_name("model.embed_tokens.weight") == "embed_tokens.weight"
    assert local_name("model.hc_head.hc_fn") == "hc_head.hc_fn"
    assert local_name("mtp.0.attn.wq_a.weight") is None
    assert local_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


def test_expert_slots():
    assert local_name("layers.2.ffn.experts.5.w1.weight") == "layers.2.mlp.experts.5.w1.weight"
    assert expert_slot("layers.2.mlp.experts.5.w1.weight", CFG) == ("layers.2.mlp.experts.gate_up_proj", (5, slice(0, 64)))
    assert expert_slot("layers.2.mlp.experts.5.w3.weight", CFG) == ("layers.2.mlp.experts.gate_up_proj",
                                                                   (5, slice(64, 128)))
    assert expert_slot("layers.2.mlp.experts.7.w2.weight", CFG) == ("layers.2.mlp.experts.down_proj", (7,))
    assert expert_slot("layers.2.mlp.experts.gate_up_proj", CFG) is None


@pytest.mark.parametrize("cfg", [CFG, ModelConfig.flash(), ModelConfig.pro()], ids=["tiny", "flash", "pro"])
def test_every_parameter_has_an_official_name(cfg):
    with torch.device("meta"):
        names = dsv4rt.Model(cfg).state_dict()
    for n in names:
        if ".experts." not in n or ".shared_experts." in n:
            assert local_name(official_name(n)) == n


# ---------------------------------------------------------------------------------------------- config
RELEASED_FLASH_CONFIG = {  # the V4-Flash hub config.json: HF keys plus the official compress_ratios
    "architectures": ["DeepseekV4ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64,
    "index_topk": 512, "max_position_embeddings": 1048576, "model_type": "deepseek_v4", "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 64, "num_experts_per_tok": 6,
    "num_hidden_layers": 43, "num_hash_layers": 3, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


@pytest.mark.parametrize("cfg", [CFG, ModelConfig.flash(), ModelConfig.pro(), CFG.replace(csa_ratio=8)],
                         ids=["tiny", "flash", "pro", "csa8"])
def test_official_config_round_trip(cfg):
    d = official_config(cfg)
    assert "dim" in d and "n_layers" in d and len(d["compress_ratios"]) == cfg.num_layers
    assert ModelConfig.from_hf(json.loads(json.dumps(d))) == cfg


def test_released_config_and_mtp_entry():
    assert ModelConfig.from_hf(RELEASED_FLASH_CONFIG) == ModelConfig.flash()
    off = official_config(ModelConfig.flash())
    off["compress_ratios"] = off["compress_ratios"] + [0]  # the MTP layer's entry is ignored
    assert ModelConfig.from_hf(off) == ModelConfig.flash()
    assert official_config(CFG)["compress_ratios"] == [0, 4, 16, 4, 16]


def test_compress_ratios_errors():
    off = official_config(CFG)
    with pytest.raises(ValueError, match="mixes HCA rates"):
        ModelConfig.from_hf({**off, "compress_ratios": [0, 4, 16, 4, 32]})
    with pytest.raises(ValueError, match="compress_rates says 128"):
        ModelConfig.from_hf({**off, "compress_rates": {"heavily_compressed_attention": 128}})


# ---------------------------------------------------------------------------------------------- round trips
@pytest.fixture(scope="module")
def hf():
    return hf_model(CFG, seed=0)


@pytest.fixture(scope="module")
def official_dir(hf, tmp_path_factory):
    d = tmp_path_factory.mktemp("official")
    save_official(d, hf, shards=3)
    return d


def dequantized(folder):
    """Every tensor of an official folder, FP8/FP4 weights decoded to float32, under its official name."""
    raw = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            raw.update(load_file(os.path.join(folder, f)))
    out = {}
    for name, t in raw.items():
        if name.endswith(".scale") and name[:-6] + ".weight" in raw:
            continue
        scale = raw.get(name[:-7] + ".scale") if name.endswith(".weight") else None
        if scale is None:
            out[name] = t if t.dtype == torch.int64 else t.float()
        elif t.dtype == torch.float8_e4m3fn:
            out[name] = dequant_fp8_block(t, scale)
        else:
            out[name] = dequant_fp4(t, scale)
    return out


@pytest.fixture(scope="module")
def hf_dequantized(official_dir, tmp_path_factory):
    """HF run on the decoded official tensors; transformers maps the official names itself."""
    from transformers import DeepseekV4ForCausalLM

    d = tmp_path_factory.mktemp("hf_deq")
    save_file(dequantized(official_dir), os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    hf_config(CFG).save_pretrained(d)
    return DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()


def test_official_layout(official_dir):
    names = weight_map(official_dir)
    files = sorted(set(names.values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    headers = {}
    for f in files:
        with safe_open(os.path.join(official_dir, f), "pt") as h:
            headers.update({k: (h.get_slice(k).get_dtype(), h.get_slice(k).get_shape()) for k in h.keys()})
    assert set(headers) == set(names)
    d, i, e = CFG.hidden_size, CFG.moe_inter, CFG.n_experts
    assert headers["layers.1.attn.wq_b.weight"] == ("F8_E4M3", [512, 64])
    assert headers["layers.1.attn.wq_b.scale"] == ("F8_E8M0", [4, 1])
    assert headers["layers.1.attn.wo_a.weight"][0] == "F8_E4M3"
    assert headers["layers.3.attn.indexer.wq_b.scale"] == ("F8_E8M0", [8, 1])
    assert headers["layers.2.ffn.experts.7.w1.weight"] == ("I8", [i, d // 2])
    assert headers["layers.2.ffn.experts.7.w1.scale"] == ("F8_E8M0", [i, d // 32])
    assert headers["layers.2.ffn.experts.7.w2.weight"] == ("I8", [d, i // 2])
    assert headers["layers.2.ffn.experts.7.w2.scale"] == ("F8_E8M0", [d, i // 32])
    assert headers["layers.0.ffn.gate.tid2eid"] == ("I64", [CFG.vocab_size, CFG.n_active])
    assert headers["layers.3.ffn.gate.bias"][0] == "F32"
    assert headers["layers.2.attn.compressor.ape"] == ("F32", [16, 128])
    assert headers["layers.2.attn.compressor.wkv.weight"][0] == "BF16"
    assert headers["embed.weight"][0] == "BF16" and headers["hc_head_fn"][0] == "F32"
    assert sum(".ffn.experts." in k and k.endswith(".weight") for k in headers) == 3 * e * CFG.num_layers
    assert ModelConfig.from_hf(official_dir) == CFG


def test_official_round_trip(official_dir, hf_dequantized, hf):
    ours = load(official_dir)
    assert ours.cfg == CFG
    assert_same_weights(ours, hf_dequantized)
    seq = tokens(24, 1)  # crosses 6 CSA windows and an HCA window
    err = rel_err(logits(ours, seq), hf_run(hf_dequantized, [seq]))
    assert err <= TOL, err


def test_hf_save_pretrained_folder(hf, tmp_path):
    hf.save_pretrained(tmp_path, max_shard_size="300KB")
    assert os.path.exists(tmp_path / INDEX_FILE)
    ours = load(tmp_path)
    assert ours.cfg == CFG
    assert_same_weights(ours, hf)
    seq = tokens(24, 2)
    err = rel_err(logits(ours, seq), hf_run(hf, [seq]))
    assert err <= TOL, err


def test_hf_names_with_fused_experts(hf, tmp_path):
    write_shards(tmp_path, {k: v.contiguous() for k, v in hf.state_dict().items()}, shards=4)
    hf.config.to_json_file(tmp_path / "config.json")
    assert_same_weights(load(tmp_path), hf)


def test_bf16_wo_a_and_fp8_experts(hf, tmp_path):
    save_official(tmp_path, hf, shards=2, wo_a="bf16", experts="fp8")
    ours = load(tmp_path)
    sd = hf.state_dict()
    assert torch.equal(ours.state_dict()["layers.1.self_attn.o_a_proj.weight"],
                       sd["model.layers.1.self_attn.o_a_proj.weight"].bfloat16().float())
    w1 = sd["model.layers.2.mlp.experts.gate_up_proj"][3, :CFG.moe_inter]
    assert torch.equal(ours.state_dict()["layers.2.mlp.experts.gate_up_proj"][3, :CFG.moe_inter],
                       dequant_fp8_block(*quant_fp8_block(w1)))


@pytest.mark.parametrize("change, message", [
    (dict(hca_ratio=CFG.csa_ratio), "CSA and HCA rates are both 4"),
    (dict(mlp_types=(MOE, HASH_MOE, MOE, MOE, MOE)), "hash-routed layers must come first"),
], ids=["csa_equals_hca", "hash_layer_not_first"])
def test_refused_save_keeps_the_checkpoint_in_the_folder(official_dir, tmp_path, change, message):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    with pytest.raises(ValueError, match=message):
        save_official(d, dsv4rt.Model.random(CFG.replace(**change)), shards=3)
    assert {f: (d / f).read_bytes() for f in os.listdir(d)} == before


@pytest.mark.parametrize("kw, message", [
    (dict(experts="bf16"), "experts must be one of 'fp4', 'fp8', got 'bf16'"),  # used to be written as fp4
    (dict(wo_a="fp16"), "wo_a must be one of 'fp8', 'bf16', got 'fp16'"),
    (dict(shards=0), r"shards must be an int in 1\.\.\d+, got 0"),
    (dict(shards="3"), r"shards must be an int in 1\.\.\d+, got '3'"),
])
def test_save_official_refuses_bad_arguments_before_writing(hf, tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        save_official(tmp_path / "out", hf, **kw)
    assert not os.path.exists(tmp_path / "out")


def test_layer_slice(official_dir):
    full = load(official_dir).state_dict()
    for layers in (2, range(2)):
        part = load(official_dir, layers=layers)
        assert part.cfg == CFG.truncated(2)
        sd = part.state_dict()
        assert all(torch.equal(v, full[k]) for k, v in sd.items())
        assert not any(k.startswith("layers.2.") for k in sd)
    assert logits(part, tokens(8, 3)).shape == (8, CFG.vocab_size)
    for bad in (range(1, 3), 0, 6, True):
        with pytest.raises(ValueError, match="layers must be"):
            load(official_dir, layers=bad)


def test_bfloat16_load_is_exact(official_dir):
    ours = dsv4rt.Model.from_pretrained(official_dir, progress=False)  # default dtype bfloat16
    ref = load(official_dir).state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(v.float(), ref[k]), k  # FP8/FP4 values and bf16 tensors are exact in bfloat16


def test_mtp_ignored_and_progress(official_dir, tmp_path, capsys):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    edit_shard(d, "model-00003-of-00003.safetensors", add={"mtp.0.attn.wkv.weight": torch.zeros(4, 4),
                                                           "mtp.0.hc_head_fn": torch.zeros(2)})
    got = dsv4rt.Model.from_pretrained(d, dtype=torch.float32).state_dict()
    err = capsys.readouterr().err
    assert "[1/3] model-00001-of-00003.safetensors" in err and "[3/3]" in err
    want = dsv4rt.Model.from_pretrained(official_dir, dtype=torch.float32).state_dict()  # the mtp.* tensors ignored
    assert got.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in got.items())


# ---------------------------------------------------------------------------------------------- bad folders
def edit_shard(folder, fname, drop=(), add=None, replace=None, index=True):
    """Rewrite one shard: drop / add / replace tensors; keep the index in step unless index=False."""
    path = os.path.join(folder, fname)
    tensors = load_file(path)
    for k in drop:
        del tensors[k]
    tensors.update(add or {})
    tensors.update(replace or {})
    save_file(tensors, path, metadata={"format": "pt"})
    if index:
        ipath = os.path.join(folder, INDEX_FILE)
        with open(ipath) as f:
            idx = json.load(f)
        for k in drop:
            del idx["weight_map"][k]
        for k in add or {}:
            idx["weight_map"][k] = fname
        with open(ipath, "w") as f:
            json.dump(idx, f)


def weight_map(folder):
    with open(os.path.join(folder, INDEX_FILE)) as f:
        return json.load(f)["weight_map"]


def shard_of(folder, name):
    return weight_map(folder)[name]


def _missing_shard(d):
    fname = "model-00002-of-00003.safetensors"
    os.remove(os.path.join(d, fname))
    return fname, next(k for k, v in weight_map(d).items() if v == fname)


def _missing_tensor(d):
    name = "layers.2.attn.compressor.ape"
    edit_shard(d, shard_of(d, name), drop=[name])
    return INDEX_FILE, name


def _missing_from_file(d):
    name = "layers.0.attn.attn_sink"
    fname = shard_of(d, name)
    edit_shard(d, fname, drop=[name], index=False)
    return fname, name


def _missing_expert(d):
    name = "layers.4.ffn.experts.6.w3.weight"
    edit_shard(d, shard_of(d, name), drop=[name, "layers.4.ffn.experts.6.w3.scale"])
    return INDEX_FILE, name


def _missing_scale(d):
    name = "layers.1.attn.wkv.scale"
    edit_shard(d, shard_of(d, name), drop=[name])
    return shard_of(d, "layers.1.attn.wkv.weight"), "layers.1.attn.wkv.weight"


def _extra_tensor(d):
    fname = "model-00001-of-00003.safetensors"
    edit_shard(d, fname, add={"layers.0.attn.bogus.weight": torch.zeros(3)})
    return fname, "layers.0.attn.bogus.weight"


def _extra_layer(d):
    name = "layers.5.attn_norm.weight"
    edit_shard(d, "model-00003-of-00003.safetensors", add={name: torch.ones(CFG.hidden_size, dtype=torch.bfloat16)})
    return "model-00003-of-00003.safetensors", name


def _duplicate_experts(d):
    fname = "model-00002-of-00003.safetensors"
    name = "layers.2.mlp.experts.down_proj"  # fused experts next to the per-expert w2 tensors
    edit_shard(d, fname, add={name: torch.zeros(CFG.n_experts, CFG.hidden_size, CFG.moe_inter)})
    return fname, name


def _wrong_shape(d):
    name = "layers.0.attn_norm.weight"
    fname = shard_of(d, name)
    edit_shard(d, fname, replace={name: torch.ones(CFG.hidden_size - 1, dtype=torch.bfloat16)})
    return fname, name


def _wrong_dtype(d):
    name = "layers.3.ffn_norm.weight"
    fname = shard_of(d, name)
    edit_shard(d, fname, replace={name: torch.ones(CFG.hidden_size, dtype=torch.int32)})
    return fname, name


def _float_hash_table(d):
    name = "layers.1.ffn.gate.tid2eid"
    fname = shard_of(d, name)
    edit_shard(d, fname, replace={name: torch.zeros(CFG.vocab_size, CFG.n_active)})
    return fname, name


def _wrong_scale_dtype(d):
    name = "layers.2.ffn.experts.0.w2.scale"
    fname = shard_of(d, name)
    edit_shard(d, fname, replace={name: torch.ones(CFG.hidden_size, CFG.moe_inter // 32, dtype=torch.float16)})
    return fname, "layers.2.ffn.experts.0.w2.weight"


def _wrong_scale_shape(d):
    name = "layers.3.attn.wq_a.scale"
    fname = shard_of(d, name)
    edit_shard(d, fname, replace={name: e8m0(0, 0).view(1, 2)})
    return fname, "layers.3.attn.wq_a.weight"


def _truncated(d):
    fname = "model-00003-of-00003.safetensors"
    path = os.path.join(d, fname)
    with safe_open(path, "pt") as f:
        names = list(f.keys())
    os.truncate(path, os.path.getsize(path) - 100)
    return fname, names  # the tensor whose bytes were cut: the last one in the file


def _corrupt_header(d):
    fname = "model-00001-of-00003.safetensors"
    with open(os.path.join(d, fname), "r+b") as f:
        f.seek(8)
        f.write(b"#")
    return fname, None


def _config_dim(d):
    edit_config(d, q_lora_rank=CFG.q_lora_rank * 2)
    return None, "layers.0.attn.q_norm.weight"


def _config_experts(d):
    edit_config(d, n_routed_experts=CFG.n_experts * 2)
    return None, "layers.0.ffn.gate.weight"


def _config_layers(d):
    edit_config(d, n_layers=CFG.num_layers - 1, compress_ratios=[0, 4, 16, 4])
    return None, "layers.4."


def edit_config(d, **kw):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.update(kw)
    with open(path, "w") as f:
        json.dump(c, f)


BAD = [_missing_shard, _missing_tensor, _missing_from_file, _missing_expert, _missing_scale, _extra_tensor,
       _extra_layer, _duplicate_experts, _wrong_shape, _wrong_dtype, _float_hash_table, _wrong_scale_dtype, _wrong_scale_shape,
       _truncated, _corrupt_header, _config_dim, _config_experts, _config_layers]


@pytest.mark.parametrize("breaker", BAD, ids=[b.__name__[1:] for b in BAD])
def test_bad_checkpoint(official_dir, tmp_path, breaker):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    fname, tensor = breaker(d)
    with pytest.raises(CheckpointError) as e:
        load(d)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    if fname is not None:
        assert fname in msg, msg
    if isinstance(tensor, list):
        assert any(t in msg for t in tensor), msg
    elif tensor is not None:
        assert tensor in msg, msg
        assert ".safetensors" in msg or INDEX_FILE in msg, msg


def test_missing_config(official_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    os.remove(d / "config.json")
    with pytest.raises(CheckpointError, match="config.json"):
        load(d)


@pytest.mark.parametrize("value", ["<official_dir>", "nonexistent", [1, 2], 3], ids=["path", "str", "list", "int"])
def test_config_must_be_a_json_object(official_dir, tmp_path, value):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    with open(d / "config.json", "w") as f:  # a string used to be read as the path of another config
        json.dump(str(official_dir) if value == "<official_dir>" else value, f)
    with pytest.raises(CheckpointError, match=r"config\.json: holds a JSON \w+, not an object of config keys"):
        load(d)


@pytest.mark.parametrize("fname, what", [("config.json", "config"), (INDEX_FILE, "index")])
def test_json_that_is_not_utf8(official_dir, tmp_path, fname, what):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    with open(d / fname, "ab") as f:
        f.write(b"\xff")
    with pytest.raises(CheckpointError, match=f"{re.escape(str(d / fname))}: unreadable {what}, not UTF-8 text"):
        load(d)


@pytest.mark.parametrize("how", ["parent", "absolute"])
def test_index_naming_a_shard_outside_the_folder(official_dir, tmp_path, how):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    fname = shard_of(d, "norm.weight")
    outside = {"parent": f"../ckpt/{fname}", "absolute": str(d / fname)}[how]  # the same file, by a path
    idx = json.loads((d / INDEX_FILE).read_text())
    idx["weight_map"] = {k: outside if v == fname else v for k, v in idx["weight_map"].items()}
    (d / INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: tensor .* is mapped to '{re.escape(outside)}', not "
                                              "the name of a file in the checkpoint folder"):
        load(d)


@pytest.mark.parametrize("fname", ["config.json", INDEX_FILE, "model-00001-of-00003.safetensors"])
def test_json_nested_too_deep(official_dir, tmp_path, fname):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    deep = b"[" * 100_000  # json raises RecursionError, not a ValueError
    (d / fname).write_bytes(struct.pack("<Q", len(deep)) + deep if fname.endswith(".safetensors") else deep)
    with pytest.raises(CheckpointError, match=f"{re.escape(str(d / fname))}: .*maximum recursion depth exceeded"):
        load(d)


def edit_header(folder, fname, edit):
    """Rewrite one shard's safetensors header as raw JSON (`edit(header)` changes it in place); the data stays."""
    path = os.path.join(folder, fname)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header, data = json.loads(f.read(n)), f.read()
    edit(header)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


SINK = "layers.0.attn.attn_sink"  # F32 [num_heads]


@pytest.mark.parametrize("entry, message", [
    (lambda e: ["F32"], "not an object"),
    (lambda e: {**e, "dtype": None}, "dtype is not a string"),
    (lambda e: {**e, "shape": [CFG.num_heads + 0.7]}, "shape is not a list of non-negative integers"),  # not 4
    (lambda e: {**e, "data_offsets": None}, "data_offsets is not a pair of non-negative integers"),
    (lambda e: {**e, "data_offsets": e["data_offsets"][:1]}, "data_offsets is not a pair of non-negative integers"),
    (lambda e: {**e, "data_offsets": [str(o) for o in e["data_offsets"]]}, "data_offsets is not a pair"),
], ids=["not_a_dict", "dtype_null", "float_shape", "offsets_null", "one_offset", "string_offsets"])
def test_malformed_header_entry(official_dir, tmp_path, entry, message):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    fname = shard_of(d, SINK)
    edit_header(d, fname, lambda h: h.update({SINK: entry(h[SINK])}))
    with pytest.raises(CheckpointError, match=f"{fname}: tensor {SINK}: malformed header entry, {message}"):
        load(d)


def _alias(h):
    """SINK's entry points at the bytes of another tensor of the same dtype and shape."""
    other = next(k for k, e in h.items() if k not in (SINK, "__metadata__") and e["shape"] == h[SINK]["shape"]
                 and e["dtype"] == h[SINK]["dtype"])
    h[SINK]["data_offsets"] = h[other]["data_offsets"]
    return rf"tensor ({re.escape(SINK)}|{re.escape(other)}) \(bytes \d+\.\.\d+ of the data section\) overlaps tensor"


def _gap(h):
    """The last tensor moves 8 bytes on (8 bytes appended keep the file's size right)."""
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    h[last]["data_offsets"] = [o + 8 for o in h[last]["data_offsets"]]
    return rf"tensor {re.escape(last)} starts at byte \d+ of the data section, leaving bytes \d+\.\.\d+ unused"


def _trailing(h):
    """The header stays; 8 bytes appended follow the last tensor."""
    return "8 bytes of the data section follow the last tensor"


@pytest.mark.parametrize("edit, grow", [(_alias, 0), (_gap, 8), (_trailing, 8)], ids=["alias", "gap", "trailing"])
def test_data_ranges_must_tile_the_file(official_dir, tmp_path, edit, grow):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    fname = shard_of(d, SINK)
    messages = []
    edit_header(d, fname, lambda h: messages.append(edit(h)))
    with open(d / fname, "ab") as f:
        f.write(b"\0" * grow)
    for read in (load, describe):  # refused from the header, before any data is read
        with pytest.raises(CheckpointError, match=f"{fname}: {messages[0]}"):
            read(d)


def test_layers_checked_before_any_header(official_dir, monkeypatch):
    import dsv4rt.checkpoint

    def refuse(path):
        raise AssertionError(f"{path} read before layers were checked")

    monkeypatch.setattr(dsv4rt.checkpoint, "read_header", refuse)
    with pytest.raises(ValueError, match=r"layers must be an int or range in 1\.\.5 \(the checkpoint has 5 blocks\), "
                                         "got 99"):
        load(official_dir, layers=99)


@pytest.mark.parametrize("bad_id", [CFG.n_experts + 91, -3])
def test_hash_table_naming_a_missing_expert(official_dir, tmp_path, bad_id):
    from dsv4rt.__main__ import main

    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    name = "layers.0.ffn.gate.tid2eid"
    fname = shard_of(d, name)
    table = load_file(d / fname)[name].clone()
    table[5, 0] = bad_id
    edit_shard(d, fname, replace={name: table})
    message = f"{fname}: tensor {name} names expert {bad_id}, outside the 8 routed experts of config.json"
    with pytest.raises(CheckpointError, match=message):
        load(d)
    with pytest.raises(SystemExit, match="cannot load the checkpoint: .*" + message):
        main(["generate", "--checkpoint", str(d), "--max-new-tokens", "1"])


def _byte(value, at=0):
    """An edit of a tensor's stored bytes: byte `at` (an index or slice of the flat bytes) set to `value`."""
    def edit(t):
        b = t.view(torch.uint8).clone()
        b.view(-1)[at] = value
        return b.view(t.dtype)
    return edit


def _nan_at(i):
    def edit(t):
        t = t.clone()
        t[i] = float("nan")
        return t
    return edit


@pytest.mark.parametrize("name, edit, dtype, message", [
    ("layers.1.attn.wkv.scale", _byte(255), torch.float32,
     r"tensor layers.1.attn.wkv.scale holds the ue8m0 byte 255, which is NaN \(block scale of layers.1.attn.wkv"),
    ("layers.2.ffn.experts.3.w2.scale", _byte(255, 7), torch.bfloat16,
     r"tensor layers.2.ffn.experts.3.w2.scale holds the ue8m0 byte 255, which is NaN"),
    ("layers.1.attn.wq_a.weight", _byte(0x7F), torch.float32,  # the e4m3 NaN code
     "tensor layers.1.attn.wq_a.weight holds NaN or infinite values once decoded with its block scale "
     "layers.1.attn.wq_a.scale"),
    ("layers.0.attn_norm.weight", _nan_at(3), torch.bfloat16, "tensor layers.0.attn_norm.weight holds NaN or infinite"),
    ("layers.1.attn.wkv.scale", _byte(127 + 20, slice(None)), torch.float16,  # 2^20: finite in float32 only
     r"tensor layers.1.attn.wkv.weight holds values past the range of torch.float16 \(largest 65504\)"),
], ids=["nan_fp8_scale", "nan_fp4_scale", "nan_fp8_code", "nan_bf16", "float16_overflow"])
def test_bad_weight_values(official_dir, tmp_path, name, edit, dtype, message):
    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    fname = shard_of(d, name)
    edit_shard(d, fname, replace={name: edit(load_file(d / fname)[name])})
    with pytest.raises(CheckpointError, match=f"{fname}: {message}"):
        dsv4rt.Model.from_pretrained(d, dtype=dtype, progress=False)


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_info_reads_headers_only(official_dir, monkeypatch, capsys):
    import safetensors

    from dsv4rt.__main__ import main

    def refuse(*a, **k):
        raise AssertionError("info must not read tensor data")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    assert main(["info", "--checkpoint", str(official_dir)]) == 0
    out = capsys.readouterr().out
    assert "schedule SCHCH (S 1, C 2, H 2)" in out
    assert "hca_ratio=16" in out
    assert f"tensors: {len(weight_map(official_dir))}" in out
    for dt in ("BF16", "F32", "F8_E4M3", "F8_E8M0", "I8", "I64"):
        assert f"  {dt} " in out
    assert "check: every tensor matches config.json" in out


def test_cli_info_reports_a_bad_checkpoint(official_dir, tmp_path, capsys):
    from dsv4rt.__main__ import main

    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    _wrong_shape(d)
    assert main(["info", "--checkpoint", str(d)]) == 1
    assert "check: FAILED" in capsys.readouterr().out
    os.remove(d / "config.json")
    assert main(["info", "--checkpoint", str(d)]) == 1
    assert "config.json: missing" in capsys.readouterr().err


def test_cli_refuses_layers_past_the_checkpoint(official_dir):
    from dsv4rt.__main__ import main

    blocks = r"layers must be an int or range in 1\.\.5 \(the checkpoint has 5 blocks\), got 99"
    with pytest.raises(SystemExit, match="cannot load the checkpoint: " + blocks):
        main(["generate", "--checkpoint", str(official_dir), "--layers", "99"])
    with pytest.raises(SystemExit, match="--layers: " + blocks):
        main(["info", "--checkpoint", str(official_dir), "--layers", "99"])


def test_cli_generate_text(official_dir, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from dsv4rt.__main__ import main

    d = tmp_path / "ckpt"
    shutil.copytree(official_dir, d)
    words = ["<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(3, CFG.vocab_size)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    argv = ["generate", "--checkpoint", str(d), "--dtype", "float32", "--max-new-tokens", "3"]
    assert main(argv + ["--prompt", "w17 w42 w7"]) == 0
    out = capsys.readouterr().out
    assert "prompt: w17 w42 w7" in out
    completion = next(line for line in out.splitlines() if line.startswith("completion: "))
    assert len(completion.split()) == 4 and all(w in words for w in completion.split()[1:])
    assert main(argv + ["--prompt-ids", "0 17 42 7"]) == 0  # token ids work with a checkpoint too
    os.remove(d / "tokenizer.json")
    with pytest.raises(SystemExit, match="tokenizer.json"):
        main(argv + ["--prompt", "w17"])
