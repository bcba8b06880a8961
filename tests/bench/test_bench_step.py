"""Decode step latency, graph-replayed (pytest --benchmark-only; cuda)."""
import pytest
import torch

import dsv4rt
from dsv4rt import bench

pytestmark = pytest.mark.cuda
BATCHES = [1, 8, 32]  # decode buckets; 3 requests would share the 4-bucket


@pytest.fixture(scope="module")
def runtime():
    model = dsv4rt.Model.random(dsv4rt.ModelConfig.tiny(), dtype=torch.bfloat16, device="cuda")
    return dsv4rt.Runtime(model, max_requests=max(BATCHES), max_context=4096 + 256, kv_dtype="fp8",
                          max_tokens_per_step=max(BATCHES))


@pytest.mark.parametrize("batch", BATCHES)
def test_bench_decode_tiny(benchmark, runtime, batch):
    handles = [runtime.admit_synthetic(4096, seed=i) for i in range(batch)]
    try:
        _, host_ms, bucket = bench.time_decode(runtime, handles, iters=5)
        graph = runtime.runner.graphs[(bucket, False)]
        benchmark.extra_info.update(device=torch.cuda.get_device_name(), batch=batch, context=4096,
                                    host_ms=host_ms, kernels=dsv4rt.ops.kernel_coverage())
        benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=50, warmup_rounds=5)
    finally:
        for h in handles:
            runtime.release(h)


@pytest.mark.parametrize("greedy", [False, True], ids=["host-logits", "greedy"])
@pytest.mark.parametrize("batch", BATCHES)
def test_bench_step_api(benchmark, runtime, batch, greedy):
    """A `Runtime.step()` decode call as a caller makes it: validation, prepare, the replay and the returned
    logits' copy to the host; greedy: `step(on_device=True)`, the argmax on the device and the token ids' copy, as
    a caller's loop on greedy_tokens does (each round advances the requests one token: 55 rounds fit the 256
    positions of room)."""
    handles = [runtime.admit_synthetic(4096, seed=i) for i in range(batch)]
    try:
        feed = {h: [1] for h in handles}
        out = runtime.step(feed, on_device=greedy)
        assert sorted(out) == sorted(handles)
        where = "cuda" if greedy else "cpu"
        assert all(v.shape == (1, runtime.model.cfg.vocab_size) and v.device.type == where for v in out.values())

        def call():
            got = runtime.step(feed, on_device=greedy)
            if greedy:
                dsv4rt.greedy_tokens(got)

        benchmark.extra_info.update(device=torch.cuda.get_device_name(), batch=batch, context=4096, greedy=greedy)
        benchmark.pedantic(call, rounds=50, warmup_rounds=4)
    finally:
        for h in handles:
            runtime.release(h)


@pytest.mark.parametrize("mode", ["greedy-tokens", "decode"])
@pytest.mark.parametrize("batch", BATCHES)
def test_bench_greedy_loop(benchmark, runtime, batch, mode):
    """Eight greedy decode steps a round, the ids read on the host once a round: through step(on_device=True) and
    greedy_tokens (the host waits for each step's ids before it prepares the next), or through decode() on the
    device's argmax (the host prepares step k+1 while the device runs step k), as generate() does at temperature 0
    without stop_at_eos. A round's time / 8 is a step's (22 rounds fit the 256 positions of room)."""
    handles = [runtime.admit_synthetic(4096, seed=i) for i in range(batch)]
    ids = torch.ones(batch, dtype=torch.int64, device="cuda")

    def round_():
        nonlocal ids
        if mode == "decode":
            for _ in range(8):
                ids = runtime.decode(handles, ids).argmax(-1)
            ids.tolist()
        else:
            toks = ids.tolist()
            for _ in range(8):
                toks = dsv4rt.greedy_tokens(runtime.step({h: [t] for h, t in zip(handles, toks)}, on_device=True))
            ids = torch.tensor(toks, device="cuda")

    try:
        benchmark.extra_info.update(device=torch.cuda.get_device_name(), batch=batch, context=4096, mode=mode,
                                    steps_per_round=8)
        benchmark.pedantic(round_, rounds=20, warmup_rounds=2)
    finally:
        for h in handles:
            runtime.release(h)
