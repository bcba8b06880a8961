"""ModelConfig presets carry the exact values of spec §1; from_hf reads HF configs; RoPE frequencies match HF."""
import math

import pytest
import torch

import dsv4rt
from dsv4rt.config import CSA, HASH_MOE, HCA, MOE, SLIDING

FLASH = dict(vocab_size=129280, hidden_size=4096, num_layers=43, num_heads=64, head_dim=512, rope_dim=64,
             q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, csa_ratio=4, hca_ratio=128,
             index_heads=64, index_head_dim=128, index_topk=512, n_experts=256, n_active=6, n_shared=1,
             moe_inter=2048, routed_scale=1.5, swiglu_limit=10.0, rope_theta=10000.0,
             compress_rope_theta=160000.0, hc_mult=4, hc_iters=20, hc_eps=1e-6, norm_eps=1e-6,
             bos_token_id=0, eos_token_id=1, max_position=1048576)
PRO = dict(FLASH, hidden_size=7168, num_layers=61, num_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024,
           n_experts=384, moe_inter=3072, routed_scale=2.5)
SCHEDULE = {"S": SLIDING, "C": CSA, "H": HCA}


@pytest.mark.parametrize("preset,values,schedule", [
    ("flash", FLASH, "SS" + "CH" * 20 + "C"),
    ("pro", PRO, "HH" + "CH" * 29 + "C"),
])
def test_preset_values(preset, values, schedule):
    cfg = getattr(dsv4rt.ModelConfig, preset)()
    for k, v in values.items():
        assert getattr(cfg, k) == v, k
    assert "".join({v: k for k, v in SCHEDULE.items()}[t] for t in cfg.layer_types) == schedule
    assert cfg.mlp_types == (HASH_MOE,) * 3 + (MOE,) * (cfg.num_layers - 3)
    assert cfg.yarn == dsv4rt.config.Yarn(16.0, 65536, 32.0, 1.0)


def test_from_hf_round_trips_to_dict_and_names_what_is_missing():
    tiny = dsv4rt.ModelConfig.tiny()
    assert dsv4rt.ModelConfig.from_hf(tiny.to_dict()) == tiny
    assert dsv4rt.ModelConfig.from_hf(dsv4rt.ModelConfig.flash().to_dict()) == dsv4rt.ModelConfig.flash()
    with pytest.raises(ValueError, match="missing field.*'vocab_size'.*'moe_intermediate_size' or 'moe_inter_dim'"):
        dsv4rt.ModelConfig.from_hf({})
    for x in (None, 42):
        with pytest.raises(TypeError, match="config object, a dict or a path"):
            dsv4rt.ModelConfig.from_hf(x)


@pytest.mark.parametrize("key,value,fragment", [
    ("eos_token_id", [], "ModelConfig.from_hf: a field is missing or invalid"),
    ("rope_scaling", [1, 2], "config: rope_scaling must be an object, got list"),
    ("compress_rates", [4, 16], "config: compress_rates must be an object, got list"),
    ("compress_ratios", 4, "config: compress_ratios must be a list, got int 4"),
    ("rope_scaling", "yarn", "config: rope_scaling must be an object, got str"),
])
def test_from_hf_refuses_fields_of_the_wrong_shape(key, value, fragment):
    """A config.json field of the wrong shape (an empty eos list, a list where a dict belongs) is a ValueError
    naming the field where it can (a CheckpointError naming config.json when it comes from a checkpoint), not an
    IndexError / AttributeError."""
    from dsv4rt.checkpoint_writer import official_config

    d = official_config(dsv4rt.ModelConfig.tiny())
    assert dsv4rt.ModelConfig.from_hf(d) == dsv4rt.ModelConfig.tiny()
    d[key] = value
    with pytest.raises(ValueError, match=fragment):
        dsv4rt.ModelConfig.from_hf(d)


def test_from_hf_refuses_what_the_forward_does_not_compute():
    """A scoring function, activation or RoPE type other than DSV4's had been ignored (the model ran as DSV4 under
    another config's name); real fields name themselves; an absent routed scale or rope width takes HF's default
    (1.5, head_dim / 8), not 1.0 and 64; sizes past what the kernels index are refused."""
    from dsv4rt.hf import hf_config_for

    tiny = dsv4rt.ModelConfig.tiny()
    d = hf_config_for(tiny).to_dict()
    assert dsv4rt.ModelConfig.from_hf(d) == tiny
    for key, value, fragment in (("scoring_func", "sigmoid", "scoring_func 'sigmoid' is not supported"),
                                 ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
                                 ("rope_parameters", {"rope_type": "linear", "factor": 2.0},
                                  "rope_type 'linear' is not supported"),
                                 ("rope_theta", "abc", "config: rope_theta must be a number, got 'abc'"),
                                 ("swiglu_limit", None, "config: swiglu_limit must be a number, got None"),
                                 ("num_hash_layers", -1, "num_hash_layers must be >= 0, got -1")):
        with pytest.raises(ValueError, match=fragment):
            dsv4rt.ModelConfig.from_hf(dict(d, **{key: value}, mlp_layer_types=None))
    bare = {k: v for k, v in d.items() if k not in ("routed_scaling_factor", "qk_rope_head_dim",
                                                    "partial_rotary_factor", "rope_parameters")}
    got = dsv4rt.ModelConfig.from_hf(dict(bare, head_dim=256, rope_parameters={"rope_type": "yarn", "beta_fast": 0}))
    assert (got.routed_scale, got.rope_dim, got.yarn.beta_fast) == (1.5, 32, 0.0)  # beta_fast 0 had become 32
    for field, value in (("vocab_size", 1 << 62), ("index_topk", 1 << 20), ("max_position", 1 << 40)):
        with pytest.raises(ValueError, match=f"ModelConfig.{field} must be"):
            tiny.replace(**{field: value})


def test_from_hf_integer_fields_are_whole_numbers():
    """Integer fields may come as 4096.0 or "4096" but not as 512.9 (int() would load 512) or "x", and the error
    names the field."""
    from dsv4rt.checkpoint_writer import official_config

    tiny = dsv4rt.ModelConfig.tiny()
    d = official_config(tiny)
    assert dsv4rt.ModelConfig.from_hf(dict(d, vocab_size=float(tiny.vocab_size), n_layers=str(tiny.num_layers))) == tiny
    for key, value, name in (("vocab_size", tiny.vocab_size + 0.9, "vocab_size"),
                             ("n_layers", 3.5, "num_hidden_layers"), ("eos_token_id", "x", "eos_token_id"),
                             ("index_topk", True, "index_topk")):
        with pytest.raises(ValueError, match=f"config: {name} must be an integer, got {value!r}"):
            dsv4rt.ModelConfig.from_hf(dict(d, **{key: value}))


def test_from_hf_keeps_an_eos_id_of_zero():
    from dsv4rt.hf import hf_config_for

    d = hf_config_for(dsv4rt.ModelConfig.tiny()).to_dict()
    d["eos_token_id"], d["bos_token_id"] = 0, 2
    cfg = dsv4rt.ModelConfig.from_hf(d)
    assert (cfg.eos_token_id, cfg.bos_token_id) == (0, 2)


def test_from_hf_config_object_and_official_dict():
    from dsv4rt.hf import hf_config_for

    tiny = dsv4rt.ModelConfig.tiny()
    assert dsv4rt.ModelConfig.from_hf(hf_config_for(tiny)) == tiny
    assert dsv4rt.ModelConfig.from_hf(hf_config_for(dsv4rt.ModelConfig.flash())) == dsv4rt.ModelConfig.flash()
    official = {"vocab_size": 129280, "dim": 4096, "n_layers": 43, "n_heads": 64, "head_dim": 512,
                "rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
                "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "index_n_heads": 64, "index_head_dim": 128,
                "index_topk": 512, "n_routed_experts": 256, "n_activated_experts": 6, "n_shared_experts": 1,
                "moe_inter_dim": 2048, "n_hash_layers": 3, "route_scale": 1.5, "swiglu_limit": 10.0,
                "rope_theta": 10000, "compress_rope_theta": 160000, "rope_factor": 16, "original_seq_len": 65536,
                "beta_fast": 32, "beta_slow": 1, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
                "norm_eps": 1e-6}
    assert dsv4rt.ModelConfig.from_hf(official) == dsv4rt.ModelConfig.flash()


def test_yarn_frequencies_match_hf_and_spec():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from dsv4rt.hf import hf_config_for

    cfg = dsv4rt.ModelConfig.flash()
    rot = DeepseekV4RotaryEmbedding(hf_config_for(cfg))
    torch.testing.assert_close(cfg.inv_freq(CSA), rot.compress_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(cfg.inv_freq(SLIDING), rot.main_inv_freq, rtol=0, atol=0)
    # spec §2: lo = 15, hi = 25 -> channels below 15 keep f0, from 25 on are divided by 16
    f0 = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    f = cfg.inv_freq(CSA)
    assert torch.equal(f[:16], f0[:16]) and torch.allclose(f[25:], f0[25:] / 16)
    assert math.isclose(float(f[20]), float(f0[20] / 16 * 0.5 + f0[20] * 0.5), rel_tol=1e-6)
