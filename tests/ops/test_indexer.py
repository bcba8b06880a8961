"""indexer family: indexer_topk scores every visible indexer entry of a query's request and keeps the top k."""
import pytest
import torch

from dsv4rt.ops.indexer import indexer_topk, indexer_topk_ref
from dsv4rt.ops.kv_quant import idx_fp4_dequantize
from dsv4rt.ops.swa import PAD_SLOT
from factories import CASE_NAMES, IDX_DIM, indexer_topk_inputs, ref_result, to_device

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FORMATS = [False, True]  # keys stored as values / as FP4 rows


def index_sets(idx):
    """Per query: the sorted real indices (order within a row is irrelevant) and the count of -1."""
    return [(sorted(i for i in row if i >= 0), sum(i == -1 for i in row)) for row in idx.tolist()]


def indexer_loop(q, weights, idx_cache, req_slot, positions, block_table, ratio, topk):
    """Per query: score[j] = sum_h w[h] relu(q[h] . k_j) for j < (p+1) // ratio; top-k by score, -1 padded."""
    per_block = idx_cache.shape[1]
    fp4 = idx_cache.dtype == torch.uint8
    keys = idx_fp4_dequantize(idx_cache, IDX_DIM, torch.float32) if fp4 else idx_cache.float()
    out = []
    for t in range(q.shape[0]):
        r, p = int(req_slot[t]), int(positions[t])
        n_vis = 0 if r == PAD_SLOT else (p + 1) // ratio
        scores = []
        for j in range(n_vis):
            key = keys[int(block_table[r, j // per_block]), j % per_block]
            dots = (q[t].float() @ key).tolist()  # one dot product per head
            s = sum(float(weights[t, h]) * max(dots[h], 0.0) for h in range(q.shape[1]))
            scores.append((s, j))
        best = [j for _, j in sorted(scores, reverse=True)[:topk]]
        out.append(best + [-1] * (topk - len(best)))
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp4", FORMATS)
def test_opcheck(device, fp4):
    torch.library.opcheck(torch.ops.dsv4rt.indexer_topk.default, indexer_topk_inputs(device, "mixed", fp4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp4", FORMATS)
def test_trace(device, fp4):
    args = indexer_topk_inputs(device, "prefill", fp4)
    expected = ref_result(indexer_topk_ref, *args)
    torch._dynamo.reset()
    got = torch.compile(indexer_topk, fullgraph=True, backend="aot_eager")(*args)
    assert index_sets(got) == index_sets(expected)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp4", FORMATS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_cuda_matches_reference(case, fp4, dtype):
    args = indexer_topk_inputs("cuda", case, fp4, dtype)
    expected = ref_result(indexer_topk_ref, *to_device(args, "cpu"))
    got = indexer_topk(*args)
    assert got.dtype == torch.int32 and got.shape == expected.shape
    assert index_sets(got.cpu()) == index_sets(expected)  # identical index sets


@pytest.mark.parametrize("fp4", FORMATS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_matches_loop(case, fp4):
    args = indexer_topk_inputs("cpu", case, fp4, torch.float32)
    got = indexer_topk(*args)
    assert got.dtype == torch.int32 and got.shape == (args[0].shape[0], args[7])
    assert index_sets(got) == index_sets(indexer_loop(*args))


def test_causal_validity_and_padding():
    # topk 64 is above every visible count: each query gets exactly its (p+1)//m visible entries, then -1s
    q, w, cache, req_slot, positions, block_table, ratio, _ = indexer_topk_inputs("cpu", "mixed", topk=64)
    got = indexer_topk(q, w, cache, req_slot, positions, block_table, ratio, 64)
    for (real, n_pad), r, p in zip(index_sets(got), req_slot.tolist(), positions.tolist()):
        n_vis = 0 if r == PAD_SLOT else (p + 1) // ratio
        assert real == list(range(n_vis))
        assert n_pad == 64 - n_vis


def test_topk_prefers_high_scores():
    # one query at position 31 (8 visible entries); entry j's key is j * e0 and q = e0 on every head with
    # positive weights: score[j] grows with j, so the top 3 are 7, 6, 5 whatever the order within the row
    q, w, cache, req_slot, positions, block_table, ratio, _ = indexer_topk_inputs("cpu", "decode1",
                                                                                   dtype=torch.float32)
    positions[0] = 31
    cache.zero_()
    r = int(req_slot[0])
    for j in range(12):
        cache[int(block_table[r, j // cache.shape[1]]), j % cache.shape[1], 0] = float(j)
    q.zero_()
    q[..., 0] = 1.0
    w = w.abs()
    got = indexer_topk(q, w, cache, req_slot, positions, block_table, ratio, 3)
    assert sorted(got[0].tolist()) == [5, 6, 7]  # entries 8..11 hold higher scores but are not yet visible
