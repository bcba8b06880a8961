"""kv_dtype="fp8": real FP8/FP4 storage equals the pure-torch fake-quant path, and stays close to HF."""
import pytest
import torch

import dsv4rt
from oracle import hf_model, hf_run

CFG = dsv4rt.ModelConfig.tiny()


def tokens(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, kv_dtype, chunks):
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=256, kv_dtype=kv_dtype)
    r = rt.admit()
    return torch.cat([rt.step({r: ch}, all_logits=True)[r] for ch in chunks])


@pytest.fixture(scope="module")
def model():
    return dsv4rt.Model.random(CFG, seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_storage_equals_fake_quant(dtype):
    model = dsv4rt.Model.random(CFG, seed=0, dtype=dtype)
    seq = tokens(80, 1)
    chunks = [seq[:37], seq[37:50]] + [[t] for t in seq[50:]]
    real = run(model, "fp8", chunks)
    sim = run(model, "fp8_sim", chunks)
    torch.testing.assert_close(real, sim, rtol=0, atol=0)  # same rounding everywhere


def test_fp8_differs_from_auto(model):
    seq = tokens(40, 2)
    assert not torch.equal(run(model, "fp8", [seq]), run(model, "auto", [seq]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_close_to_hf(seed):
    hf = hf_model(CFG, seed=seed)
    ours = dsv4rt.Model.from_hf_state_dict(CFG, hf.state_dict())
    seq = tokens(90, 3)
    got = run(ours, "fp8", [seq[:60]] + [[t] for t in seq[60:]])
    ref = hf_run(hf, [seq])
    # Cosine similarity of the whole logit tensor (measured 0.987-0.993 over seeds 0-2). Single positions
    # dip lower (0.81-0.91) where FP4 indexer keys flip a top-k or routing choice: discrete, expected.
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    print(f"fp8 vs HF cosine similarity (seed {seed}): {cos:.5f}")
    assert cos >= 0.98
