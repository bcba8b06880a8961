"""norm family: rms_norm, rope_rotate, head_norm_rope (ops/norm.py; kernels csrc/norm.cu).

On CPU: opcheck, fullgraph trace, the references against a loop written from the definitions, and the errors.
On CUDA: each kernel against its reference on the same device: rotations bit for bit; norms within one unit in the
last place of bf16 / fp16 with most elements bit for bit, four units of fp32 (their fp32 sums of squares add in
another order).
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4rt.ops import norm
from dsv4rt.ops.norm import (head_norm_rope_ref, idx_fp4_hadamard_fake_quant_ref, kv_fp8_fake_quant_ref,
                             kv_norm_rope_quant_ref, rms_norm_ref, rope_rotate_ref)
from dsv4rt.ops.rope import rope_table

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# one unit in the last place, relative, of each dtype (the norms' tolerance): bf16 8 bits, fp16 11. fp32 results are
# not rounded to a coarser type, so the sum order shows in them: four units, and no bit-for-bit share asked
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}
EPS = 1e-6

# (shape of x, rope_dim): Flash q [T, 64, 512] / kv [T, 512] / indexer q [T, 64, 128] with rope 64, a tiny config's
# head (64, rope 32), and widths that take the kernels' element path (no whole 16-byte groups)
ROPE_SHAPES = [((1, 64, 512), 64), ((3, 512), 64), ((5, 64, 128), 64), ((4, 2, 64), 32), ((2, 3, 10), 6),
               ((7, 6), 6)]
NORM_SHAPES = [(1, 4096), (64, 4096), (3, 1024), (2, 5, 512), (4, 100), (3, 7)]


def _x(shape, dtype, device, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def _table(n_tok, rope_dim, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 1 << 20, (n_tok,), generator=g, dtype=torch.int32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    cos, sin = rope_table(pos, inv_freq)
    return cos.to(device), sin.to(device)


def _weight(d, device, seed=2):
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(d, generator=g)).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = _x((3, 2, 64), torch.bfloat16, device)
    cos, sin = _table(3, 32, device)
    torch.library.opcheck(torch.ops.dsv4rt.rms_norm.default, (x, _weight(64, device), EPS))
    torch.library.opcheck(torch.ops.dsv4rt.rope_rotate.default, (x, cos, sin, True))
    torch.library.opcheck(torch.ops.dsv4rt.head_norm_rope.default, (x, cos, sin, EPS))
    torch.library.opcheck(torch.ops.dsv4rt.kv_fp8_fake_quant.default, (_x((3, 128), torch.bfloat16, device), 64))
    torch.library.opcheck(torch.ops.dsv4rt.idx_fp4_hadamard_fake_quant.default, (x,))
    cos64, sin64 = _table(3, 64, device)
    for fp8 in (True, False):
        torch.library.opcheck(torch.ops.dsv4rt.kv_norm_rope_quant.default,
                              (_x((3, 128), torch.bfloat16, device), _weight(128, device), cos64, sin64, EPS, fp8))


@pytest.mark.parametrize("device", DEVICES)
def test_trace(device):
    x = _x((4, 2, 64), torch.bfloat16, device)
    cos, sin = _table(4, 32, device)
    w = _weight(64, device)

    def f(x, cos, sin, w):
        q = norm.head_norm_rope(x, cos, sin, EPS)
        return norm.rope_rotate(norm.rms_norm(q, w, EPS), cos, sin, inverse=True)

    expected = rope_rotate_ref(rms_norm_ref(head_norm_rope_ref(x, cos, sin, EPS), w, EPS), cos, sin, True)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, cos, sin, w)
    tol = {"rtol": 0, "atol": 0} if device == "cpu" else {"rtol": 4 * ULP[x.dtype], "atol": 1e-6}
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_trace_kv_norm_rope_quant(device):
    """Traced, the op runs unchanged: its reference on the CPU, its kernel on CUDA (compared with the three ops below)."""
    x, w = _x((5, 128), torch.bfloat16, device), _weight(128, device)
    cos, sin = _table(5, 64, device)
    expected = (kv_norm_rope_quant_ref(x, w, cos, sin, EPS, True) if device == "cpu"
                else norm.kv_norm_rope_quant(x, w, cos, sin, EPS, True))
    torch._dynamo.reset()
    got = torch.compile(norm.kv_norm_rope_quant, fullgraph=True, backend="aot_eager")(x, w, cos, sin, EPS, True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rope_reference_is_the_rotation():
    """rope_rotate_ref rotates each pair (a, b) of the last rope_dim channels by its token's angle (float64 loop)."""
    x = _x((3, 2, 10), torch.float32, "cpu")
    pos = torch.tensor([0, 5, 1000], dtype=torch.int32)
    inv_freq = torch.tensor([1.0, 0.1, 0.01])
    cos, sin = rope_table(pos, inv_freq)
    for inverse in (False, True):
        got = rope_rotate_ref(x, cos, sin, inverse)
        sign = -1.0 if inverse else 1.0
        for t in range(3):
            for h in range(2):
                row = x[t, h].tolist()
                want = row[:4]
                for j in range(3):
                    a, b = row[4 + 2 * j], row[5 + 2 * j]
                    ang = sign * float(pos[t]) * float(inv_freq[j])
                    want += [a * math.cos(ang) - b * math.sin(ang), b * math.cos(ang) + a * math.sin(ang)]
                torch.testing.assert_close(got[t, h], torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_norm_references_follow_the_definitions():
    """rms_norm_ref: w * x / sqrt(mean(x^2) + eps); head_norm_rope_ref: that without w per head, then the rotation."""
    x = _x((2, 3, 8), torch.float32, "cpu")
    w = _weight(8, "cpu")
    x64 = x.double()
    want = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(rms_norm_ref(x, w, EPS).double(), want, rtol=1e-6, atol=1e-6)
    cos, sin = _table(2, 4, "cpu")
    y = (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)).float()
    torch.testing.assert_close(head_norm_rope_ref(x, cos, sin, EPS), rope_rotate_ref(y, cos, sin, False),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_problem(device):
    x = _x((3, 2, 64), torch.bfloat16, device)
    cos, sin = _table(3, 32, device)
    with pytest.raises(RuntimeError, match="weight must be"):
        norm.rms_norm(x, _weight(32, device), EPS)
    with pytest.raises(RuntimeError, match="weight must be"):
        norm.rms_norm(x, _weight(64, device).half(), EPS)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        norm.rope_rotate(x, cos[:2], sin[:2])
    with pytest.raises(RuntimeError, match="float32"):
        norm.rope_rotate(x, cos.half(), sin.half())
    with pytest.raises(RuntimeError, match="exceeds the row width"):
        norm.rope_rotate(x[..., :16], cos, sin)
    with pytest.raises(RuntimeError, match=r"\[T, H, D\]"):
        norm.head_norm_rope(x[:, 0], cos, sin, EPS)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        norm.rms_norm(x.to(torch.float64), _weight(64, device), EPS)
    with pytest.raises(RuntimeError, match="positive multiple of 64"):
        norm.kv_fp8_fake_quant(x, 32)
    with pytest.raises(RuntimeError, match="must be 32, 64, 128 or 256"):
        norm.idx_fp4_hadamard_fake_quant(x[..., :48])
    with pytest.raises(RuntimeError, match=r"x must be \[T, D\]"):
        norm.kv_norm_rope_quant(x, _weight(64, device), cos, sin, EPS, True)
    with pytest.raises(RuntimeError, match="with fp8, width - rope_dim must be a positive multiple of 64"):
        norm.kv_norm_rope_quant(x[:, 0], _weight(64, device), cos, sin, EPS, True)
    with pytest.raises(RuntimeError, match="weight must be"):
        norm.kv_norm_rope_quant(x[:, 0], _weight(32, device), cos, sin, EPS, False)


@pytest.mark.cuda
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,rope_dim", ROPE_SHAPES)
def test_cuda_rope_rotate_bit_exact(shape, rope_dim, dtype, inverse):
    x = _x(shape, dtype, "cuda")
    cos, sin = _table(shape[0], rope_dim, "cuda")
    out = norm.rope_rotate(x, cos, sin, inverse)
    torch.testing.assert_close(out, rope_rotate_ref(x, cos, sin, inverse), rtol=0, atol=0)


def _close_and_mostly_equal(out, ref, dtype, ulps=1.0, equal_frac=0.9):
    """Within `ulps` units of the dtype (fp32: absolute 1e-6 too, for rotated pairs that cancel); in bf16 / fp16 at
    least `equal_frac` of the elements bit for bit."""
    atol = 1e-6 if dtype == torch.float32 else 1e-30
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulps * ULP[dtype], atol=atol)
    if dtype != torch.float32:
        frac = (out == ref).float().mean().item()
        assert frac >= equal_frac, f"only {frac:.3f} of the elements equal the reference's bits"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_cuda_rms_norm(shape, dtype):
    x = _x(shape, dtype, "cuda")
    w = _weight(shape[-1], "cuda")
    _close_and_mostly_equal(norm.rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,rope_dim", [s for s in ROPE_SHAPES if len(s[0]) == 3])
def test_cuda_head_norm_rope(shape, rope_dim, dtype):
    """The factor is rounded to the dtype: a factor one unit off moves its whole row by about one unit (2 allowed)."""
    x = _x(shape, dtype, "cuda")
    cos, sin = _table(shape[0], rope_dim, "cuda")
    _close_and_mostly_equal(norm.head_norm_rope(x, cos, sin, EPS), head_norm_rope_ref(x, cos, sin, EPS), dtype,
                            ulps=2.0, equal_frac=0.8)


@pytest.mark.cuda
def test_cuda_misaligned_rows_take_the_element_path():
    """A view 2 bytes past an aligned address (contiguous): the kernels read it element by element."""
    buf = _x((1 + 3 * 512,), torch.bfloat16, "cuda")
    x = buf[1:].view(3, 512)
    assert x.data_ptr() % 16 != 0
    w = _weight(512, "cuda")
    cos, sin = _table(3, 64, "cuda")
    _close_and_mostly_equal(norm.rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), torch.bfloat16)
    torch.testing.assert_close(norm.rope_rotate(x, cos, sin), rope_rotate_ref(x, cos, sin, False), rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_graph_replay(capture_graph):
    x = _x((2, 64, 512), torch.bfloat16, "cuda")
    cos, sin = _table(2, 64, "cuda")
    w = _weight(512, "cuda")
    graph, out = capture_graph(lambda: norm.rms_norm(norm.head_norm_rope(x, cos, sin, EPS), w, EPS))
    x.copy_(_x((2, 64, 512), torch.bfloat16, "cuda", seed=5))
    graph.replay()
    torch.testing.assert_close(out, norm.rms_norm(norm.head_norm_rope(x, cos, sin, EPS), w, EPS), rtol=0, atol=0)


def _quant_rows(shape, dtype, seed=0):
    """Rows of every scale (1e-6 .. 1e3, so some blocks sit below the amax floors), with a zero row and -0.0s."""
    x = _x(shape, torch.float32, "cpu", seed=seed)
    rows = x.reshape(-1, shape[-1])
    rows *= torch.logspace(-6, 3, rows.shape[0])[:, None]
    rows[0] = 0.0
    rows[1, ::3] = -0.0
    return x.to(dtype).cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,rope_dim", [((40, 512), 64), ((3, 16, 128), 64), ((5, 192), 0)])
def test_cuda_kv_fp8_fake_quant_bit_exact(shape, rope_dim, dtype):
    x = _quant_rows(shape, dtype)
    torch.testing.assert_close(norm.kv_fp8_fake_quant(x, rope_dim), kv_fp8_fake_quant_ref(x, rope_dim),
                               rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [32, 64, 128, 256])
def test_cuda_idx_fp4_hadamard_fake_quant_bit_exact(width, dtype):
    x = _quant_rows((7, 9, width), dtype)
    out, ref = norm.idx_fp4_hadamard_fake_quant(x), idx_fp4_hadamard_fake_quant_ref(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert torch.equal(torch.signbit(out), torch.signbit(ref))  # -0.0 where the reference has it


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,rope_dim", [((1, 512), 64), ((64, 512), 64), ((3, 128), 64), ((5, 192), 64),
                                            ((2, 1088), 64), ((4, 4096), 64), ((3, 100), 36)])
def test_cuda_kv_norm_rope_quant_equals_the_three_ops(shape, rope_dim, dtype, fp8):
    """Bit for bit with rms_norm -> rope_rotate -> kv_fp8_fake_quant on the same device: the one-launch kernel where
    a row is at most 256 16-byte groups with its rope channels whole groups (Flash's kv [512] with rope 64), the three
    launches elsewhere (4,096 channels; 100 channels; fp32 rows of 1,088)."""
    if fp8 and (shape[-1] - rope_dim) % 64:
        pytest.skip("FP8 rows need width - rope_dim a multiple of 64")
    x, w = _x(shape, dtype, "cuda"), _weight(shape[-1], "cuda")
    cos, sin = _table(shape[0], rope_dim, "cuda")
    want = norm.rope_rotate(norm.rms_norm(x, w, EPS), cos, sin)
    if fp8:
        want = norm.kv_fp8_fake_quant(want, rope_dim)
    got = norm.kv_norm_rope_quant(x, w, cos, sin, EPS, fp8)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.cuda
def test_cuda_kv_norm_rope_quant_misaligned_and_replayed(capture_graph):
    """A row start off 16 bytes takes the three launches; a captured call replays on new values."""
    buf = _x((3 * 512 + 1,), torch.bfloat16, "cuda")
    x, w = buf[1:].view(3, 512), _weight(512, "cuda")
    cos, sin = _table(3, 64, "cuda")
    want = norm.kv_fp8_fake_quant(norm.rope_rotate(norm.rms_norm(x, w, EPS), cos, sin), 64)
    torch.testing.assert_close(norm.kv_norm_rope_quant(x, w, cos, sin, EPS, True), want, rtol=0, atol=0)
    y = _x((3, 512), torch.bfloat16, "cuda")
    graph, out = capture_graph(lambda: norm.kv_norm_rope_quant(y, w, cos, sin, EPS, True))
    y.copy_(_x((3, 512), torch.bfloat16, "cuda", seed=7))
    graph.replay()
    want = norm.kv_fp8_fake_quant(norm.rope_rotate(norm.rms_norm(y, w, EPS), cos, sin), 64)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
