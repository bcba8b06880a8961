"""Host-side helpers of `python -m dsv4rt bench` that run on any device (the timed parts need CUDA)."""
from __future__ import annotations

import pytest
import torch

import dsv4rt
from dsv4rt import bench
from dsv4rt.config import ModelConfig


def test_distinct_experts_counts_each_moe_layer():
    cfg = ModelConfig.tiny()
    model = dsv4rt.Model.random(cfg, seed=0, dtype=torch.float32)
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=128)
    handles = [rt.admit_synthetic(64, seed=i) for i in range(2)]
    segs, new_blocks = rt._validate({h: [1] for h in handles})
    rt._allocate(segs, new_blocks)
    rt._launch(segs, all_logits=False)  # fills the step inputs as the timed loop does
    seen = bench._distinct_experts(rt, 2)
    assert len(seen) == cfg.num_layers  # one moe_experts call a layer, whatever keyword options it passes
    assert all(1 <= n <= min(cfg.n_experts, 2 * cfg.n_active) for n in seen)


def test_hf_baseline_out_of_memory_gives_no_number(monkeypatch, capsys):
    """An HF eager baseline that runs out of device memory leaves "-" in the table instead of ending the run."""
    import dsv4rt.hf

    def oom(model):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.")

    monkeypatch.setattr(dsv4rt.hf, "hf_model_for", oom)
    model = dsv4rt.Model.random(ModelConfig.tiny(), seed=0, dtype=torch.float32)
    assert bench.hf_decode_ms(model, batch=8, context=64) is None
    err = capsys.readouterr().err
    assert "HF eager baseline skipped at batch 8, context 64: out of device memory" in err
    row = bench.Row("tiny", 8, 64, 1.0, 0.25, 0.5, None, 0.1)
    assert "| - | - |" in row.markdown()


def test_profile_groups_name_each_kernel_family():
    """`--profile` sums a step's kernel time by group: every csrc/ family's kernels are found by name (the
    `*_kernel` convention), and profiler names (as torch.profiler prints them on an H200) land in their groups."""
    from dsv4rt import ops
    assert set(bench.csrc_kernels().values()) == {p.stem for p in ops.CSRC.glob("*.cu")}
    cases = {
        "void dsv4rt::(anonymous namespace)::hc_mix_finish_kernel<24, 4, __nv_bfloat16, 1>(dsv4rt::HcMixArgs, int, int)":
            "dsv4rt mhc",
        "dsv4rt::(anonymous namespace)::moe_hash_route_kernel(float const*, void const*, bool, long)": "dsv4rt moe",
        "void dsv4rt::(anonymous namespace)::rope_rows_kernel<__nv_bfloat16, 8, true>(__nv_bfloat16 const*)":
            "dsv4rt norm",
        "void dsv4rt::(anonymous namespace)::sparse_attn_combine_kernel<__nv_bfloat16>(dsv4rt::SparseAttnArgs)":
            "dsv4rt attention",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>":
            "torch (plain ops)",
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "GEMM (cuBLAS/CUTLASS)",
        "Memcpy DtoD (Device -> Device)": "copy / memset",
    }
    for name, group in cases.items():
        assert bench.kernel_group(name) == group, name


def test_time_prefill_times_a_fresh_request_and_releases_it():
    model = dsv4rt.Model.random(ModelConfig.tiny(), seed=0, dtype=torch.float32)
    rt = dsv4rt.Runtime(model, max_requests=1, max_context=128, max_tokens_per_step=64)
    ms = bench.time_prefill(rt, 40, iters=2)
    assert ms > 0
    assert rt.live == []  # every timed request released: a second run admits again
    assert bench.time_prefill(rt, 40, iters=1) > 0
    with pytest.raises(ValueError, match="iters must be at least 1"):
        bench.time_prefill(rt, 40, iters=0)


def test_active_weight_params_counts_n_active_routed_experts():
    cfg = ModelConfig.tiny()
    model = dsv4rt.Model.random(cfg, seed=0, dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())
    embed, head = model.embed_tokens.weight.numel(), model.lm_head.weight.numel()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    # the routed experts a token does not use, by another route: each layer's share of the idle experts
    idle = experts * (cfg.n_experts - cfg.n_active) // cfg.n_experts
    assert bench.active_weight_params(model) == total - embed - head - idle
    assert bench.prefill_flops(model, 10) == 2 * (10 * (total - embed - head - idle) + head)
    assert "| tiny | 10 | 2.00 | 5000 |" in bench.prefill_row("tiny", 10, 2.0, bench.prefill_flops(model, 10))


@pytest.mark.parametrize("argv, message", [
    (["--batches", "1,x"], "--batches: 'x' is not an integer"),
    (["--prefill", "0"], "--prefill: 0 must be at least 1"),
    (["--batches=", "--long-contexts="], "nothing to run"),
])
def test_bench_cli_refuses_bad_lists_before_any_work(argv, message, capsys):
    from dsv4rt.__main__ import main
    with pytest.raises(SystemExit, match=message):
        main(["bench", *argv])


@pytest.mark.parametrize("argv, message", [
    (["generate", "--layers", "0"], "--layers must be at least 1, got 0"),  # 0 used to run the whole model
    (["generate", "--experts", "0"], "--experts must be at least 1, got 0"),
    (["info", "--layers", "0"], "--layers must be at least 1"),
    (["bench", "--layers", "-2"], "--layers must be at least 1, got -2"),
    (["generate", "--layers", "99"], "--layers: layers must be in 1..5, got 99"),
    (["generate", "--seed", str(1 << 70)], "--seed: seed must be in \\[-2\\*\\*63, 2\\*\\*64\\)"),
    (["generate", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
    (["generate", "--max-new-tokens", "2000000"], "prompt's 5 tokens plus the new ones exceed the model's "
                                                   "max_position"),
    (["generate", "--prompt-ids", "1 99999"], "generate: prompt 0: token id 99999 outside the vocabulary"),
    (["generate", "--temperature", "-1"], "generate: sampling needs a temperature >= 0"),
    (["generate", "--device", "cuda:0" if not torch.cuda.is_available() else "nonsense"], "--device"),
])
def test_cli_refuses_bad_arguments_with_a_message(argv, message):
    """CLI refusals name the option (SystemExit with a message, no traceback), before any model is built where
    they can."""
    from dsv4rt.__main__ import main
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_run_prefill_prints_one_row_a_chunk(capsys):
    rows = bench.run_prefill("tiny", chunks=(16, 40), kv_dtype="auto", dtype=torch.float32, iters=1, device="cpu")
    assert [c for c, _ in rows] == [16, 40] and all(ms > 0 for _, ms in rows)
    out = capsys.readouterr().out
    assert bench.PREFILL_HEADER in out
    assert sum(line.startswith("| tiny L5 E") for line in out.splitlines()) == 2


def test_preset_config_takes_zero_as_zero():
    """layers=0 or experts=0 had been read as "not given" and returned the whole preset."""
    assert bench.preset_config("tiny", layers=2).num_layers == 2
    with pytest.raises(ValueError, match="layers must be in 1..5, got 0"):
        bench.preset_config("tiny", layers=0)
    with pytest.raises(ValueError, match="n_experts must be a positive int"):
        bench.preset_config("tiny", experts=0)
    with pytest.raises(ValueError, match="preset must be one of tiny, flash, pro, got 'huge'"):
        bench.preset_config("huge")
