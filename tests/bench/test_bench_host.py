"""Host work of a decode step (CPU or GPU): `Runtime.step` with the forward replaced by a constant, so what is timed
is validation, block allocation, prepare, the staging and input copies and the per-request logit split. `step()` is
synchronous, so on a GPU this host work adds to every step's latency.

Run: python -m pytest tests/bench/test_bench_host.py --benchmark-only -s
Besides the timing, each case checks what a steady decode step must not do: copy block-table rows (none changed).
"""
from __future__ import annotations

import pytest
import torch

import dsv4rt

CASES = [(1, 4096), (64, 4096), (64, 1 << 20)]  # (batch, max_context): the 1M table is 65 x 8,192 blocks


@pytest.fixture(scope="module")
def model():
    return dsv4rt.Model.random(dsv4rt.ModelConfig.tiny(), seed=0)


@pytest.mark.parametrize("batch,max_context", CASES)
def test_bench_step_host(benchmark, model, block_rows_copied, batch, max_context):
    rt = dsv4rt.Runtime(model, max_requests=batch, max_context=max_context, num_blocks=batch * 40,
                        max_tokens_per_step=batch)
    logits = torch.zeros(rt.rows_cap, model.cfg.vocab_size)
    rt._fn = lambda st: logits[: st.logit_rows.shape[0]]  # no forward: the host work alone
    # 133 tokens: just past a block boundary (132), so the 113 steps below allocate no block (the next one is at 256)
    handles = [rt.admit_synthetic(133, seed=i) for i in range(batch)]
    step = {h: [1] for h in handles}
    for _ in range(3):
        rt.step(step)
    del block_rows_copied[:]  # the steady steps only
    copied = block_rows_copied
    out = benchmark.pedantic(lambda: rt.step(step), rounds=100, warmup_rounds=10)
    assert sorted(out) == sorted(handles) and all(v.shape == (1, model.cfg.vocab_size) for v in out.values())
    assert copied and all(rows == [] for rows in copied), "a steady decode step copied block-table rows"
    if benchmark.stats is not None:  # None under --benchmark-disable: the checks above still ran
        us = benchmark.stats.stats.median * 1e6
        benchmark.extra_info.update(batch=batch, max_context=max_context, median_us=us)
        print(f"\nhost work of a decode step, batch {batch}, max_context {max_context}: {us:.0f} us (median)")
