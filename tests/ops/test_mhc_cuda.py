"""CUDA kernels of the mHC family (csrc/mhc.cu) against the references of ops/mhc.py (run on the CPU, fp32).

Shapes: n = 4 streams (plus n = 1, 2, 3, 8 at small sizes), D = 128 (tiny model) and 4096 (Flash), T = 1, 7, 64,
300 tokens, x in float32 and bfloat16, 1 and 20 Sinkhorn iterations. hc_pre / hc_head run two kernels when n*D is
large (the mix split over CTAs, partial sums staged in the output rows) and one otherwise; DSV4RT_MHC_SPLIT=0
forces the single-kernel path at Flash size too. Outputs are poisoned: the caching allocator is handed NaN-filled
blocks of the outputs' sizes just before the call, so the op's fresh outputs start as NaN (an element the kernel
failed to write, or a partial sum read from the wrong place, shows).
Tolerances (the mix sums n*D products in another order; 2 * iters - 1 Sinkhorn normalisations in the reference's
order): fp32 outputs within 1e-5 of the reference's largest magnitude; bf16 outputs within one bf16 ulp of the
reference value (plus the same 1e-5).
"""
from __future__ import annotations

import pytest
import torch

from dsv4rt.ops.mhc import (hc_head, hc_head_ref, hc_post, hc_post_pre, hc_post_pre_ref, hc_post_ref, hc_pre,
                            hc_pre_ref)

pytestmark = pytest.mark.cuda

EPS, NORM_EPS = 1e-6, 1e-6
REL = 1e-5  # fp32 math, different summation order
TOKENS = [1, 7, 64, 300]
DIMS = [128, 4096]  # tiny model, Flash
DTYPES = [torch.float32, torch.bfloat16]


def _pre_inputs(n_tok: int, n: int, d: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    m = (2 + n) * n
    x = torch.randn(n_tok, n, d, generator=g).to(dtype)
    fn = torch.randn(m, n * d, generator=g) * 2.0 * (n * d) ** -0.5  # mix O(1): sigmoid/softmax not saturated
    base = torch.randn(m, generator=g) * 0.5
    scale = torch.tensor([0.7, 1.3, 2.0])
    return x, fn, base, scale


def _head_inputs(n_tok: int, n: int, d: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, n, d, generator=g).to(dtype)
    fn = torch.randn(n, n * d, generator=g) * 2.0 * (n * d) ** -0.5
    return x, fn, torch.randn(n, generator=g) * 0.5, torch.tensor([1.5])


def _post_inputs(n_tok: int, n: int, d: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, n, d, generator=g).to(dtype)
    y = torch.randn(n_tok, d, generator=g).to(dtype)
    post = 2 * torch.sigmoid(torch.randn(n_tok, n, generator=g))
    comb = torch.softmax(2 * torch.randn(n_tok, n, n, generator=g), dim=-1)  # not symmetric
    return x, y, post, comb


def _cuda(args: tuple) -> tuple:
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def _poisoned(fn, shapes_dtypes):
    """Run fn() right after freeing NaN-filled blocks of the outputs' sizes (the allocator hands them out again)."""
    poison = [torch.full(s, float("nan"), dtype=dt, device="cuda") for s, dt in shapes_dtypes]
    del poison
    return fn()


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    got, want = got.cpu().float(), want.float()
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten output?)"
    tol = REL * want.abs().max().clamp_min(1e-30)
    err = (got - want).abs()
    assert (err <= tol).all(), f"{what}: max |err| {err.max().item():.3g} > {tol.item():.3g}"


def _assert_close_dtype(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if want.dtype != torch.bfloat16:
        return _assert_close(got, want, what)
    g, w = got.cpu().float(), want.float()
    assert torch.isfinite(g).all(), f"{what}: non-finite values (unwritten output?)"
    # one bf16 ulp of the reference value: 2^(floor(log2 |w|) - 7)
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - 7)
    bound = ulp + REL * w.abs().max()
    err = (g - w).abs()
    assert (err <= bound).all(), f"{what}: {(err > bound).sum().item()} values off by more than one bf16 ulp"


def _check_pre(n_tok, n, d, dtype, iters):
    args = _pre_inputs(n_tok, n, d, dtype)
    want = hc_pre_ref(*args, iters, EPS, NORM_EPS)
    dev = _cuda(args)
    got = _poisoned(lambda: hc_pre(*dev, iters, EPS, NORM_EPS),
                    [((n_tok, d), dtype), ((n_tok, n), torch.float32), ((n_tok, n, n), torch.float32)])
    for name, g, w in zip(("x", "post", "comb"), got, want):
        _assert_close_dtype(g, w, f"hc_pre {name}")


@pytest.mark.parametrize("iters", [1, 20])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_hc_pre_matches_reference(n_tok, d, dtype, iters):
    _check_pre(n_tok, 4, d, dtype, iters)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_hc_head_matches_reference(n_tok, d, dtype):
    args = _head_inputs(n_tok, 4, d, dtype)
    want = hc_head_ref(*args, EPS, NORM_EPS)
    dev = _cuda(args)
    got = _poisoned(lambda: hc_head(*dev, EPS, NORM_EPS), [((n_tok, d), dtype)])
    _assert_close_dtype(got, want, "hc_head")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_hc_post_matches_reference(n_tok, d, dtype):
    args = _post_inputs(n_tok, 4, d, dtype)
    want = hc_post_ref(*args)
    dev = _cuda(args)
    got = _poisoned(lambda: hc_post(*dev), [((n_tok, 4, d), dtype)])
    _assert_close_dtype(got, want, "hc_post")


# n other than 4: mix rows (2+n)n = 3, 8, 15, 80 (every register-tile size), n*n > 32 Sinkhorn lanes at n = 8;
# d = 1024 splits the mix over CTAs for n >= 3, d = 128 does not
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [128, 1024])
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_other_stream_counts(n, d, dtype):
    _check_pre(7, n, d, dtype, 20)
    args = _head_inputs(7, n, d, dtype)
    _assert_close_dtype(hc_head(*_cuda(args), EPS, NORM_EPS), hc_head_ref(*args, EPS, NORM_EPS), "hc_head")
    args = _post_inputs(7, n, d, dtype)
    _assert_close_dtype(hc_post(*_cuda(args)), hc_post_ref(*args), "hc_post")


@pytest.mark.parametrize("n_tok", [1, 64])
def test_single_kernel_path(monkeypatch, n_tok):
    """DSV4RT_MHC_SPLIT=0: the finish kernel computes the whole mix (the path of small n*D) at Flash size."""
    monkeypatch.setenv("DSV4RT_MHC_SPLIT", "0")
    for dtype in DTYPES:
        _check_pre(n_tok, 4, 4096, dtype, 20)
        args = _head_inputs(n_tok, 4, 4096, dtype)
        _assert_close_dtype(hc_head(*_cuda(args), EPS, NORM_EPS), hc_head_ref(*args, EPS, NORM_EPS), "hc_head")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sinkhorn_registers_match_shared_memory(monkeypatch, n):
    """n <= 4: the Sinkhorn matrix held in registers (a reciprocal a line, then multiplies) against
    the shared-memory form (DSV4RT_MHC_SINKHORN=smem: an element a lane, IEEE divisions), before and after a split
    mix: x and post the same bits, comb within a few fp32 ulps (the reference tests bound both against plain torch)."""
    for d in (128, 1024):
        dev = _cuda(_pre_inputs(7, n, d, torch.bfloat16))
        monkeypatch.delenv("DSV4RT_MHC_SINKHORN", raising=False)
        x, post, comb = hc_pre(*dev, 20, EPS, NORM_EPS)
        monkeypatch.setenv("DSV4RT_MHC_SINKHORN", "smem")
        x_s, post_s, comb_s = hc_pre(*dev, 20, EPS, NORM_EPS)
        assert torch.equal(x, x_s) and torch.equal(post, post_s)
        torch.testing.assert_close(comb, comb_s, rtol=1e-5, atol=1e-7)
        assert not torch.equal(comb, torch.zeros_like(comb))


@pytest.mark.parametrize("n_tok", [1, 300])
def test_programmatic_launch_equals_plain(monkeypatch, n_tok):
    """hc_post -> hc_pre -> hc_head back to back with programmatic dependent launches (the default: each grid may
    start before the one it reads has finished, and hc_pre's finish grid loads x before its wait) gives the same
    bits as plain launches (DSV4RT_MHC_PDL=0); 300 tokens take the kernels' two-CTAs-an-SM instances."""
    d = 4096
    x, fn, base, scale = _cuda(_pre_inputs(n_tok, 4, d, torch.bfloat16))
    _, hfn, hbase, hscale = _cuda(_head_inputs(n_tok, 4, d, torch.bfloat16, seed=1))
    y = torch.randn(n_tok, d, device="cuda").to(torch.bfloat16)
    post0, comb0 = torch.rand(n_tok, 4, device="cuda"), torch.rand(n_tok, 4, 4, device="cuda")

    def chain():
        streams = hc_post(x, y, post0, comb0)
        xc, post, comb = hc_pre(streams, fn, base, scale, 20, EPS, NORM_EPS)
        streams = hc_post(streams, y + xc, post, comb)
        return streams, xc, post, comb, hc_head(streams, hfn, hbase, hscale, EPS, NORM_EPS)

    got = chain()
    monkeypatch.setenv("DSV4RT_MHC_PDL", "0")
    want = chain()
    for u, v in zip(got, want):
        assert torch.equal(u, v)


def test_deterministic():
    """Fixed reduction order: two calls give the same bits (the trace tests compare kernel with kernel exactly)."""
    dev = _cuda(_pre_inputs(64, 4, 4096, torch.bfloat16))
    a, b = hc_pre(*dev, 20, EPS, NORM_EPS), hc_pre(*dev, 20, EPS, NORM_EPS)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    dev = _cuda(_head_inputs(64, 4, 4096, torch.bfloat16))
    assert torch.equal(hc_head(*dev, EPS, NORM_EPS), hc_head(*dev, EPS, NORM_EPS))


@pytest.mark.parametrize("n_tok", [1, 64])
def test_graph_replay(n_tok, capture_graph):
    """hc_pre -> hc_post -> hc_head captured in one CUDA graph; replays on new input values equal eager calls."""
    d = 4096
    x, fn, base, scale = _cuda(_pre_inputs(n_tok, 4, d, torch.bfloat16))
    _, hfn, hbase, hscale = _cuda(_head_inputs(n_tok, 4, d, torch.bfloat16, seed=1))
    y = torch.randn(n_tok, d, device="cuda").to(torch.bfloat16)

    def step():
        xc, post, comb = hc_pre(x, fn, base, scale, 20, EPS, NORM_EPS)
        streams = hc_post(x, y + xc, post, comb)
        return xc, post, comb, streams, hc_head(streams, hfn, hbase, hscale, EPS, NORM_EPS)

    graph, outs = capture_graph(step)
    for seed in (2, 3):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=g).to(x.dtype))
        y.copy_(torch.randn(y.shape, generator=g).to(y.dtype))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, step()):
            assert torch.equal(got, want)


@pytest.mark.parametrize("split", ["", "0"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n_tok", [1, 64, 300])
@pytest.mark.parametrize("op", ["hc_pre", "hc_head"])
def test_norm_weight_matches_reference(monkeypatch, op, n_tok, d, dtype, split):
    """With norm_weight the finish kernel RMS-normalises the collapsed row (warps meeting at a named barrier): equal,
    within one ulp of the output (bf16) or REL (fp32), to rms_norm_ref over the op's own collapsed row without the
    norm (which the other tests hold to the reference: a collapsed bf16 value may round an ulp apart, and a value
    near zero from cancellation by more, relative to its size); post and comb equal the call without the norm bit
    for bit. Both kernel paths (the mix split over CTAs or not). The kernel sums the squares in another order and
    takes rsqrtf: r within a few fp32 ulps, so an output rounds at most one ulp apart."""
    from dsv4rt.ops.norm import rms_norm_ref
    monkeypatch.setenv("DSV4RT_MHC_SPLIT", split)
    make, fn = (_pre_inputs, hc_pre) if op == "hc_pre" else (_head_inputs, hc_head)
    args = make(n_tok, 4, d, dtype)
    extra = (20, EPS, NORM_EPS) if op == "hc_pre" else (EPS, NORM_EPS)
    w = 0.5 + torch.rand(d, generator=torch.Generator().manual_seed(1))
    dev = _cuda(args)
    got = _poisoned(lambda: fn(*dev, *extra, w.cuda(), 1e-5), [((n_tok, d), dtype)])
    plain = fn(*dev, *extra)
    if op == "hc_pre":
        assert all(torch.equal(a, b) for a, b in zip(got[1:], plain[1:]))
        got, plain = got[0], plain[0]
    want = rms_norm_ref(plain.cpu(), w, 1e-5)
    assert not torch.equal(want, plain.cpu())  # the norm did something
    if dtype == torch.float32:
        return _assert_close(got, want, f"{op} with norm_weight")
    g, wf = got.cpu().float(), want.float()
    assert torch.isfinite(g).all(), "non-finite values (unwritten output?)"
    bound = torch.exp2(torch.floor(torch.log2(wf.abs().clamp_min(1e-30))) - 7)
    assert ((g - wf).abs() <= bound).all(), f"{((g - wf).abs() > bound).sum().item()} values off by > 1 bf16 ulp"


@pytest.mark.parametrize("fuse", ["", "0"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_hc_post_pre_equals_post_then_pre(monkeypatch, n_tok, d, dtype, norm, fuse):
    """hc_post_pre equals hc_post then hc_pre (CUDA) bit for bit, all four outputs: where the mix is split (Flash
    dims) the partial grid makes the streams itself (post_mix, hc_post's own arithmetic) and sums their stored
    values in the same order; DSV4RT_MHC_POST_FUSE=0 runs hc_post's grid first. Outputs poisoned. And close to the
    references: the streams to hc_post_ref's, the rest to hc_pre_ref's over these streams (bf16 streams may round
    an ulp apart from the reference's, which moves a mix over 16K channels by more than REL)."""
    monkeypatch.setenv("DSV4RT_MHC_POST_FUSE", fuse)
    x, y, post, comb = _post_inputs(n_tok, 4, d, dtype)
    fn, base, scale = _pre_inputs(n_tok, 4, d, dtype, seed=3)[1:]
    extra = (20, EPS, NORM_EPS) + ((0.5 + torch.rand(d, generator=torch.Generator().manual_seed(2)), 1e-5)
                                   if norm else ())
    args = (x, y, post, comb, fn, base, scale) + extra
    dev = _cuda(args)
    got = _poisoned(lambda: hc_post_pre(*dev), [((n_tok, 4, d), dtype), ((n_tok, d), dtype),
                                                ((n_tok, 4), torch.float32), ((n_tok, 4, 4), torch.float32)])
    streams = hc_post(*dev[:4])
    want = (streams, *hc_pre(streams, *dev[4:]))
    for name, g, w in zip(("streams", "x", "post", "comb"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name}: {(g != w).sum().item()} values differ from hc_post then hc_pre"
    _assert_close_dtype(got[0], hc_post_ref(*args[:4]), "hc_post_pre streams")
    if not norm:
        ref = hc_pre_ref(got[0].cpu(), *args[4:])
        for name, g, w in zip(("x", "post", "comb"), got[1:], ref):
            _assert_close_dtype(g, w, f"hc_post_pre {name}")


def test_errors():
    x, fn, base, scale = _cuda(_pre_inputs(3, 4, 128, torch.float32))
    with pytest.raises(RuntimeError, match="hc_pre: fn must"):
        torch.ops.dsv4rt.hc_pre.default(x, fn.double(), base, scale, 20, EPS, NORM_EPS)
    with pytest.raises(RuntimeError, match="hc_pre: x must be float32 or bfloat16"):
        torch.ops.dsv4rt.hc_pre.default(x.half(), fn, base, scale, 20, EPS, NORM_EPS)
    x9 = torch.randn(2, 9, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"hc_head: n = x.size\(1\) must be in \[1, 8\]"):
        torch.ops.dsv4rt.hc_head.default(x9, torch.randn(9, 72, device="cuda"), torch.randn(9, device="cuda"),
                                         torch.ones(1, device="cuda"), EPS, NORM_EPS)
    with pytest.raises(RuntimeError, match="hc_pre: norm_weight must have 128 elements"):
        torch.ops.dsv4rt.hc_pre.default(x, fn, base, scale, 20, EPS, NORM_EPS, torch.ones(64, device="cuda"), EPS)
    with pytest.raises(RuntimeError, match="hc_pre: norm_weight must be 16-byte aligned"):
        torch.ops.dsv4rt.hc_pre.default(x, fn, base, scale, 20, EPS, NORM_EPS, torch.ones(129, device="cuda")[1:],
                                        EPS)
    y = torch.randn(3, 128, device="cuda")
    post, comb = torch.rand(3, 4, device="cuda"), torch.rand(3, 4, 4, device="cuda")
    with pytest.raises(RuntimeError, match="hc_post_pre: y must be a contiguous"):
        torch.ops.dsv4rt.hc_post_pre.default(x, y.bfloat16(), post, comb, fn, base, scale, 20, EPS, NORM_EPS)
    with pytest.raises(RuntimeError, match="hc_post_pre: fn must"):
        torch.ops.dsv4rt.hc_post_pre.default(x, y, post, comb, fn[:-1], base, scale, 20, EPS, NORM_EPS)
    x6 = torch.randn(2, 4, 6, device="cuda")
    with pytest.raises(RuntimeError, match="hc_post: D = x.size\\(2\\) must be a positive multiple of 4"):
        torch.ops.dsv4rt.hc_post.default(x6, torch.randn(2, 6, device="cuda"), torch.rand(2, 4, device="cuda"),
                                         torch.rand(2, 4, 4, device="cuda"))
