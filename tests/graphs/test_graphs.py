"""CUDA graph capture and replay of the whole step (cuda tests; run in their own pytest process)."""
import pytest
import torch

import dsv4rt
from oracle import hf_model, hf_run, rel_err

pytestmark = pytest.mark.cuda
CFG = dsv4rt.ModelConfig.tiny()
# Capture correctness does not depend on code generation; aot_eager keeps these tests quick to start.
# tests/bench and `python -m dsv4rt bench` run the inductor backend.
BACKEND = "aot_eager"


def tokens(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return dsv4rt.Model.random(CFG, seed=0, device="cuda")


def drive(rt, n_requests=3):
    """Prefill chunks of every size class, decodes at batch 1..n (3 requests land in the 4-bucket)."""
    seqs = [tokens(90, 10 + i) for i in range(n_requests)]
    hs = [rt.admit() for _ in seqs]
    outs = []
    sizes = [1, 2, 3, 5, 8, 16, 31]  # prefill chunks for request 0: buckets 1, 2, 4, 8, 8, 16, 32
    pos = 0
    for s in sizes:
        outs.append(rt.step({hs[0]: seqs[0][pos:pos + s]}, all_logits=True)[hs[0]])
        pos += s
    outs.append(torch.cat(list(rt.step({hs[1]: seqs[1][:20], hs[2]: seqs[2][:9]}, all_logits=True).values())))
    for i in range(12):  # decode: batch 3 (bucket 4), then batch 2, then batch 1
        live = hs[: 3 - i // 4]
        out = rt.step({h: [seqs[j][pos + i if j == 0 else 20 + i]] for j, h in enumerate(live)})
        outs += list(out.values())
    return torch.cat(outs)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_replay_equals_eager(model, kv_dtype):
    kw = dict(max_requests=4, max_context=128, kv_dtype=kv_dtype, max_tokens_per_step=32)
    eager = drive(dsv4rt.Runtime(model, graphs=False, **kw))
    rt = dsv4rt.Runtime(model, graphs=True, backend=BACKEND, **kw)
    replayed = drive(rt)
    assert set(k[0] for k in rt.runner.graphs) == {1, 2, 4, 8, 16, 32}
    err = rel_err(replayed, eager)
    print(f"replay vs eager ({kv_dtype}): {err:.2e} relative")
    assert err <= (1e-6 if kv_dtype == "auto" else 1e-3)  # fp8: see tests/test_compile.py on rounding flips


def test_graph_mode_parity_with_hf():
    hf = hf_model(CFG, seed=0)
    ours = dsv4rt.Model.from_hf_state_dict(CFG, hf.state_dict(), device="cuda")
    hf = hf.cuda()
    seq = tokens(90, 3)
    rt = dsv4rt.Runtime(ours, max_requests=2, max_context=128, max_tokens_per_step=32, backend=BACKEND)
    r = rt.admit()
    got = torch.cat([rt.step({r: seq[:45]}, all_logits=True)[r]] +
                    [rt.step({r: [t]}, all_logits=True)[r] for t in seq[45:]])
    ref = hf_run(hf, [seq]).cpu()
    err = rel_err(got, ref)
    print(f"graph mode vs HF (float32, cuda): {err:.2e} relative")
    assert err <= 1e-4


def test_thousand_decode_steps_no_recapture_no_alloc_no_sync(model):
    rt = dsv4rt.Runtime(model, max_requests=8, max_context=1024, max_tokens_per_step=16, backend=BACKEND)
    n_graphs = len(rt.runner.graphs)
    g = torch.Generator().manual_seed(0)
    live = {rt.admit(): 0 for _ in range(5)}
    for h in live:
        rt.step({h: tokens(7, h)})
        live[h] = 7
    torch.cuda.synchronize()
    mem = torch.cuda.memory_allocated()
    for step in range(1000):
        if step % 37 == 5 and len(live) > 1:  # churn: release one, admit one, both between replays
            h = list(live)[int(torch.randint(len(live), (1,), generator=g))]
            rt.release(h)
            del live[h]
        if step % 37 == 20 and len(live) < 8:
            live[rt.admit()] = 0
        batch = {h: [int(torch.randint(CFG.vocab_size, (1,), generator=g))] for h in live}
        segments, new_blocks = rt._validate(batch)
        rt._allocate(segments, new_blocks)
        torch.cuda.set_sync_debug_mode("error")  # raises on any synchronising call inside the step
        try:
            logits, owners = rt._launch(segments, all_logits=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        logits.cpu()  # reading the logits: the one synchronisation
        for s in segments:
            rt._requests[s.handle].pos += 1
        assert torch.cuda.memory_allocated() == mem, f"step {step}: memory_allocated moved"
    assert len(rt.runner.graphs) == n_graphs  # no recapture
    assert rt.runner.replays >= 1000


def test_decode_replays_on_device_ids(model):
    """decode() writes the device's ids into the captured step's inputs: the same graphs as step() and its logits
    bit for bit, with no host read of the ids; an id outside the vocabulary runs clamped and refuses its request
    at synchronize()."""
    kw = dict(max_requests=3, max_context=128, max_tokens_per_step=32, backend=BACKEND)
    ref, rt = dsv4rt.Runtime(model, **kw), dsv4rt.Runtime(model, **kw)
    prompts = [tokens(9, 1), tokens(17, 2), tokens(4, 3)]
    ha, hb = [ref.admit() for _ in prompts], [rt.admit() for _ in prompts]
    ref.step(dict(zip(ha, prompts)))
    rt.step(dict(zip(hb, prompts)))
    n_graphs = len(rt.runner.graphs)
    ids = torch.tensor([5, 6, 7], device="cuda")
    for _ in range(8):
        want = ref.step({h: [t] for h, t in zip(ha, ids.tolist())})
        got = rt.decode(hb, ids)
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), torch.cat([want[h] for h in ha]), rtol=0, atol=0)
        ids = got.argmax(-1)
    assert len(rt.runner.graphs) == n_graphs  # the bucket-4 graph step() captured, replayed
    bad = ids.clone()
    bad[1] = CFG.vocab_size
    got = rt.decode(hb, bad)
    want = ref.step({ha[0]: [int(ids[0])], ha[1]: [CFG.vocab_size - 1], ha[2]: [int(ids[2])]})
    torch.testing.assert_close(got.cpu(), torch.cat([want[h] for h in ha]), rtol=0, atol=0)
    rt.synchronize()
    with pytest.raises(dsv4rt.RequestError, match="outside the vocabulary"):
        rt.decode(hb, ids)
    got = rt.decode([hb[0], hb[2]], ids[[0, 2]])
    want = ref.step({ha[0]: [int(ids[0])], ha[2]: [int(ids[2])]})
    torch.testing.assert_close(got.cpu(), torch.cat([want[ha[0]], want[ha[2]]]), rtol=0, atol=0)


def test_on_device_logits_and_greedy_generate(model):
    """step(on_device=True) returns the host path's values on the device, kept across later replays (the replayed
    output's buffer is reused); greedy generate(), which takes the argmax on the device, picks the tokens that the
    host logits' argmax picks."""
    kw = dict(max_requests=2, max_context=128, max_tokens_per_step=32, backend=BACKEND)
    host_rt, dev_rt = dsv4rt.Runtime(model, **kw), dsv4rt.Runtime(model, **kw)
    a, b = host_rt.admit(), dev_rt.admit()
    seq = tokens(40, 5)
    first = dev_rt.step({b: seq[:20]}, all_logits=True, on_device=True)[b]
    assert first.device.type == "cuda" and first.shape == (20, CFG.vocab_size)
    kept = first.clone()
    want = host_rt.step({a: seq[:20]}, all_logits=True)[a]
    for t in seq[20:]:
        got = dev_rt.step({b: [t]}, on_device=True)[b]
        torch.testing.assert_close(got.cpu(), host_rt.step({a: [t]})[a], rtol=0, atol=0)
    torch.testing.assert_close(first, kept, rtol=0, atol=0)  # later replays left the caller's copy alone
    torch.testing.assert_close(first.cpu(), want, rtol=0, atol=0)
    host_rt.release(a)
    dev_rt.release(b)

    prompts = [tokens(9, 6), tokens(3, 7)]
    rt = dsv4rt.Runtime(model, **kw)
    hs = [rt.admit() for _ in prompts]
    feed, picked = dict(zip(hs, prompts)), [[] for _ in prompts]
    for _ in range(6):  # the greedy loop on host logits
        out = rt.step(feed)
        feed = {}
        for i, h in enumerate(hs):
            picked[i].append(int(out[h][-1].argmax()))
            feed[h] = [picked[i][-1]]
    for h in hs:
        rt.release(h)
    assert rt.generate(prompts, max_new_tokens=6) == picked
