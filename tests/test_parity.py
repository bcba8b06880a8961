"""Parity with HF transformers DeepseekV4 (float32, kv_dtype="auto") on a tiny model with every layer type."""
import pytest
import torch

import dsv4rt
from oracle import hf_model, hf_run, rel_err

TOL = 1e-4  # max |dlogit| <= TOL * max |logit| (the bound; measured ~1e-6)
CFG = dsv4rt.ModelConfig.tiny()  # S, C, H, C, H; W=16, m=4, m'=16, topk=4, 16 indexer heads


@pytest.fixture(scope="module")
def pair():
    hf = hf_model(CFG, seed=0)
    ours = dsv4rt.Model.from_hf_state_dict(dsv4rt.ModelConfig.from_hf(hf.config), hf.state_dict())
    return hf, ours


def tokens(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_chunks(rt, handle, chunks):
    return torch.cat([rt.step({handle: ch}, all_logits=True)[handle] for ch in chunks])


def test_config_round_trip(pair):
    hf, ours = pair
    assert ours.cfg == CFG


def test_full_prefill(pair):
    hf, ours = pair
    prompt = tokens(70, 1)  # crosses 17 CSA and 4 HCA windows; indexer top-4 is selective
    rt = dsv4rt.Runtime(ours, max_requests=2, max_context=256)
    got = rt.step({rt.admit(): prompt}, all_logits=True)
    assert rel_err(next(iter(got.values())), hf_run(hf, [prompt])) <= TOL


def test_prefill_then_40_decodes(pair):
    hf, ours = pair
    seq = tokens(61, 2)
    chunks = [seq[:21]] + [[t] for t in seq[21:]]
    rt = dsv4rt.Runtime(ours, max_requests=2, max_context=256)
    got = run_chunks(rt, rt.admit(), chunks)
    assert rel_err(got, hf_run(hf, [seq])) <= TOL


def test_uneven_chunks_then_decodes(pair):
    hf, ours = pair
    seq = tokens(100, 3)
    sizes = [5, 13, 1, 30, 7, 3]  # windows close mid-chunk, at chunk edges, and several per chunk
    chunks, i = [], 0
    for s in sizes:
        chunks.append(seq[i:i + s])
        i += s
    chunks += [[t] for t in seq[i:]]
    rt = dsv4rt.Runtime(ours, max_requests=2, max_context=256, max_tokens_per_step=16)  # also splits the 30-chunk
    got = run_chunks(rt, rt.admit(), chunks)
    assert rel_err(got, hf_run(hf, [seq])) <= TOL


def test_decode_and_prefill_in_one_step(pair):
    hf, ours = pair
    a, b = tokens(40, 4), tokens(33, 5)
    rt = dsv4rt.Runtime(ours, max_requests=4, max_context=256)
    ra, rb = rt.admit(), rt.admit()
    got_a = [rt.step({ra: a[:30]}, all_logits=True)[ra]]
    got_b = []
    out = rt.step({ra: a[30:31], rb: b[:20]}, all_logits=True)  # ra decodes while rb prefills
    got_a.append(out[ra])
    got_b.append(out[rb])
    for i in range(31, 40):
        out = rt.step({rb: b[20 + i - 31:21 + i - 31], ra: a[i:i + 1]}, all_logits=True)
        got_a.append(out[ra])
        got_b.append(out[rb])
    assert rel_err(torch.cat(got_a), hf_run(hf, [a])) <= TOL
    assert rel_err(torch.cat(got_b), hf_run(hf, [b[:29]])) <= TOL


def test_release_then_readmit_same_slot(pair):
    hf, ours = pair
    rt = dsv4rt.Runtime(ours, max_requests=1, max_context=256)
    first = tokens(50, 6)
    r = rt.admit()
    run_chunks(rt, r, [first[:37], first[37:38], first[38:39]])
    rt.release(r)
    second = tokens(45, 7)
    r2 = rt.admit()  # the only slot: same ring, same compressor state rows, reused blocks
    got = run_chunks(rt, r2, [second[:2], second[2:25]] + [[t] for t in second[25:]])
    assert rel_err(got, hf_run(hf, [second])) <= TOL


def test_last_position_logits(pair):
    hf, ours = pair
    seq = tokens(20, 8)
    rt = dsv4rt.Runtime(ours, max_requests=2, max_context=256)
    r = rt.admit()
    last = rt.step({r: seq})[r]
    assert last.shape == (1, CFG.vocab_size)
    assert rel_err(last[0], hf_run(hf, [seq])[-1]) <= TOL
