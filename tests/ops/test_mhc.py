"""mhc family: hc_pre (mix, Sinkhorn, collapse), hc_post, hc_head, against the formulas of spec §4."""
import math

import pytest
import torch

from dsv4rt.ops.mhc import (hc_head, hc_head_ref, hc_post, hc_post_pre, hc_post_pre_ref, hc_post_ref, hc_pre,
                            hc_pre_ref)
from factories import (assert_trace_matches_reference, hc_head_inputs, hc_post_inputs, hc_pre_inputs, ref_result,
                       to_device)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.bfloat16]

# CUDA vs CPU reference (all fp32 math): max |diff| <= TOL * max |reference| per output; fp32 outputs 1e-5
# (reduction order over n*D channels, 39 Sinkhorn normalisations); bf16 outputs add one bf16 ulp (2^-8).
MHC_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-5 + 2**-8}

def _with_norm(factory):
    """The factory's args plus a norm weight ([D] fp32, not all ones) and its eps: the collapsed row rms_norm'd."""
    def make(device, dtype=torch.bfloat16, n_tokens=5, seed=0):
        args = factory(device, dtype, n_tokens, seed)
        d = args[0].shape[-1]
        w = 0.5 + torch.rand(d, generator=torch.Generator().manual_seed(seed + 1))
        return args + (w.to(args[0].device), 1e-5)
    return make


def hc_post_pre_inputs(device, dtype=torch.bfloat16, n_tokens=5, seed=0):
    """hc_post's inputs, then hc_pre's parameters (fn, base, scale, iters, eps, norm_eps)."""
    return hc_post_inputs(device, dtype, n_tokens, seed) + hc_pre_inputs(device, dtype, n_tokens, seed + 7)[1:]


OPS = {  # name -> (factory, reference, wrapper)
    "hc_pre": (hc_pre_inputs, hc_pre_ref, hc_pre),
    "hc_post": (hc_post_inputs, hc_post_ref, hc_post),
    "hc_head": (hc_head_inputs, hc_head_ref, hc_head),
    "hc_pre_norm": (_with_norm(hc_pre_inputs), hc_pre_ref, hc_pre),
    "hc_head_norm": (_with_norm(hc_head_inputs), hc_head_ref, hc_head),
    "hc_post_pre": (hc_post_pre_inputs, hc_post_pre_ref, hc_post_pre),
    "hc_post_pre_norm": (_with_norm(hc_post_pre_inputs), hc_post_pre_ref, hc_post_pre),
}


def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def _mix(xt, fn, norm_eps):
    """(fn . f) * rsqrt(mean(f^2) + eps), f = flatten(X) stream-major, in float64."""
    f = xt.double().reshape(-1)
    return (fn.double() @ f) / math.sqrt(float((f * f).mean()) + norm_eps)


def hc_pre_loop(x, fn, base, scale, iters, eps, norm_eps):
    n_tok, n, _ = x.shape
    xs, posts, combs = [], [], []
    for t in range(n_tok):
        mix = _mix(x[t], fn, norm_eps).tolist()
        pre = [_sigmoid(mix[j] * float(scale[0]) + float(base[j])) + eps for j in range(n)]
        post = [2 * _sigmoid(mix[n + j] * float(scale[1]) + float(base[n + j])) for j in range(n)]
        c = [[mix[2 * n + n * j + k] * float(scale[2]) + float(base[2 * n + n * j + k]) for k in range(n)]
             for j in range(n)]
        for j in range(n):  # softmax over k, then + eps
            m = max(c[j])
            z = sum(math.exp(v - m) for v in c[j])
            c[j] = [math.exp(v - m) / z + eps for v in c[j]]

        def col_norm(c):
            sums = [sum(c[j][k] for j in range(n)) for k in range(n)]
            return [[c[j][k] / (sums[k] + eps) for k in range(n)] for j in range(n)]

        c = col_norm(c)
        for _ in range(iters - 1):
            c = [[v / (sum(row) + eps) for v in row] for row in c]
            c = col_norm(c)
        xs.append(sum(pre[j] * x[t, j].double() for j in range(n)))
        posts.append(post)
        combs.append(c)
    return torch.stack(xs).to(x.dtype), torch.tensor(posts, dtype=torch.float32), torch.tensor(combs,
                                                                                               dtype=torch.float32)


def hc_post_loop(x, y, post, comb):
    n_tok, n, _ = x.shape
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(n_tok):
        for k in range(n):  # destination stream k: post[k] y + sum_j C[j][k] X[j]
            out[t, k] = float(post[t, k]) * y[t].double() + sum(float(comb[t, j, k]) * x[t, j].double()
                                                                for j in range(n))
    return out.to(x.dtype)


def hc_head_loop(x, fn, base, scale, eps, norm_eps):
    n_tok, n, _ = x.shape
    out = []
    for t in range(n_tok):
        mix = _mix(x[t], fn, norm_eps).tolist()
        pre = [_sigmoid(mix[j] * float(scale[0]) + float(base[j])) + eps for j in range(n)]
        out.append(sum(pre[j] * x[t, j].double() for j in range(n)))
    return torch.stack(out).to(x.dtype)


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)


def _assert_outputs_close(got, want, rel):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        atol = rel[w.dtype] * w.float().abs().max().item()
        torch.testing.assert_close(g.cpu().float(), w.float(), rtol=0, atol=atol)


# ------------------------------------------------------------------------------------------ generic
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_opcheck(name, device):
    torch.library.opcheck(getattr(torch.ops.dsv4rt, name.removesuffix("_norm")).default, OPS[name][0](device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_trace(name, device):
    factory, ref, wrapper = OPS[name]
    assert_trace_matches_reference(wrapper, ref, factory(device))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tokens", [1, 5, 64])
@pytest.mark.parametrize("name", list(OPS))
def test_cuda_matches_reference(name, n_tokens, dtype):
    factory, ref, wrapper = OPS[name]
    args = factory("cuda", dtype, n_tokens)
    expected = ref_result(ref, *to_device(args, "cpu"))
    _assert_outputs_close(wrapper(*args), expected, MHC_TOL)


# ------------------------------------------------------------------------------------------ semantics
@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_pre_matches_formulas(dtype):
    args = hc_pre_inputs("cpu", dtype)
    x, post, comb = hc_pre(*args)
    x_want, post_want, comb_want = hc_pre_loop(*args)
    torch.testing.assert_close(post, post_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.float(), x_want.float(), **_tol(dtype))
    # the last Sinkhorn step normalises columns (sum over j); C is not symmetric
    torch.testing.assert_close(comb.sum(-2), torch.ones(comb.shape[:-1]), rtol=0, atol=1e-5)
    assert not torch.allclose(comb, comb.transpose(-1, -2), atol=1e-3)


@pytest.mark.parametrize("iters", [1, 3])
def test_hc_pre_sinkhorn_iterations(iters):
    x, fn, base, scale, _, eps, norm_eps = hc_pre_inputs("cpu", torch.float32)
    _, _, comb = hc_pre(x, fn, base, scale, iters, eps, norm_eps)
    _, _, comb_want = hc_pre_loop(x, fn, base, scale, iters, eps, norm_eps)
    torch.testing.assert_close(comb, comb_want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_post_matches_formula(dtype):
    args = hc_post_inputs("cpu", dtype)
    torch.testing.assert_close(hc_post(*args).float(), hc_post_loop(*args).float(), **_tol(dtype))
    # direction: j (first index of C) is the source stream; the transposed mix is a different result
    x, y, post, comb = args
    transposed = hc_post_loop(x, y, post, comb.transpose(-1, -2))
    assert not torch.allclose(hc_post(*args).float(), transposed.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_head_matches_formula(dtype):
    args = hc_head_inputs("cpu", dtype)
    torch.testing.assert_close(hc_head(*args).float(), hc_head_loop(*args).float(), **_tol(dtype))


def _rms_norm_loop(x, w, eps):
    """w * x / sqrt(mean(x^2) + eps) per row, float64, rounded to x's dtype."""
    xd = x.double()
    return (w.double() * xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["hc_pre_norm", "hc_head_norm"])
def test_norm_weight_normalises_the_collapsed_row(name, dtype):
    """With norm_weight the collapsed row comes back through rms_norm(., norm_weight, out_eps): the formula loop's
    collapsed row (rounded to x's dtype, as the op returns it without the norm) normalised in float64."""
    factory, _, wrapper = OPS[name]
    *args, w, out_eps = factory("cpu", dtype)
    plain = (hc_pre_loop if name == "hc_pre_norm" else hc_head_loop)(*args)
    got = wrapper(*args, w, out_eps)
    if name == "hc_pre_norm":
        torch.testing.assert_close(got[1], plain[1], rtol=1e-5, atol=1e-5)  # post and comb: the norm leaves them
        torch.testing.assert_close(got[2], plain[2], rtol=1e-5, atol=1e-5)
        got, plain = got[0], plain[0]
    want = _rms_norm_loop(plain, w, out_eps)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
    assert not torch.allclose(got.float(), plain.float(), **_tol(dtype))  # the norm did something


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["hc_pre_norm", "hc_head_norm"])
def test_norm_weight_errors(name, device):
    factory, _, wrapper = OPS[name]
    *args, w, out_eps = factory(device, torch.float32)
    op = name.removesuffix("_norm")
    with pytest.raises(RuntimeError, match=f"{op}: norm_weight must"):
        wrapper(*args, w[:-4], out_eps)
    with pytest.raises(RuntimeError, match=f"{op}: norm_weight must"):
        wrapper(*args, w.double(), out_eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_post_pre_is_post_then_pre(dtype):
    """hc_post_pre = hc_post, then hc_pre on its output: the formula loops composed (streams, x, post, comb)."""
    args = hc_post_pre_inputs("cpu", dtype)
    streams, x, post, comb = hc_post_pre(*args)
    want_streams = hc_post_loop(*args[:4])
    torch.testing.assert_close(streams.float(), want_streams.float(), **_tol(dtype))
    for got, want in zip((x, post, comb), hc_pre_loop(streams, *args[4:])):
        torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
