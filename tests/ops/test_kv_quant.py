"""kv_quant family: FP8 row layout, FP4 indexer rows, their dequantisation, the Hadamard transform."""
import math

import pytest
import torch

from dsv4rt.ops import kv_quant
from dsv4rt.ops.kv_quant import (hadamard, idx_fp4_dequantize, idx_fp4_dequantize_ref, idx_fp4_fake_quant,
                                 idx_fp4_quantize, idx_fp4_quantize_ref, kv_fp8_dequantize, kv_fp8_dequantize_ref,
                                 kv_fp8_fake_quant, kv_fp8_quantize, kv_fp8_quantize_ref)
from factories import (assert_trace_matches_reference, idx_fp4_dequantize_inputs, idx_fp4_quantize_inputs, kv_fp8_dequantize_inputs,
                       kv_fp8_quantize_inputs, ref_result, to_device)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.bfloat16]

# op name -> (factory, reference, wrapper). Every op here is quantisation or its inverse: compared exactly.
OPS = {
    "kv_fp8_quantize": (kv_fp8_quantize_inputs, kv_fp8_quantize_ref, kv_fp8_quantize),
    "kv_fp8_dequantize": (kv_fp8_dequantize_inputs, kv_fp8_dequantize_ref, kv_fp8_dequantize),
    "idx_fp4_quantize": (idx_fp4_quantize_inputs, idx_fp4_quantize_ref, idx_fp4_quantize),
    "idx_fp4_dequantize": (idx_fp4_dequantize_inputs, idx_fp4_dequantize_ref, idx_fp4_dequantize),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_opcheck(name, device):
    factory = OPS[name][0]
    torch.library.opcheck(getattr(torch.ops.dsv4rt, name).default, factory(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_trace(name, device):
    factory, ref, wrapper = OPS[name]
    assert_trace_matches_reference(wrapper, ref, factory(device))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(OPS))
def test_reference_on_cuda_matches_cpu(name, dtype):
    """These codecs are not step ops and have no CUDA kernel (kernel_coverage() says "reference"): the reference
    runs on CUDA tensors and must give the CPU's bytes."""
    factory, ref, wrapper = OPS[name]
    args = factory("cuda", dtype=dtype)
    expected = ref_result(ref, *to_device(args, "cpu"))
    got = wrapper(*args)
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ FP8 rows
def test_fp8_row_bytes():
    assert kv_quant.fp8_row_bytes(512, 64) == 448 + 128 + 8 == 584
    assert kv_quant.fp8_row_bytes(128, 64) == 64 + 128 + 8
    assert kv_fp8_quantize(torch.randn(3, 512), 64).shape == (3, 584)
    with pytest.raises(ValueError, match="positive multiple of 64, got 36"):
        kv_quant.fp8_row_bytes(100, 64)  # nope 36 is no multiple of the 64-wide block


def _fp8_scale_byte(amax: float) -> int:
    return 127 + math.ceil(math.log2(max(amax, 1e-4) / 448.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_row_layout_by_hand(dtype):
    # width 256, rope 64: nope [0, 192) in three blocks of 64, rope bf16 bytes [192, 320), scales [320, 323),
    # pad [323, 328)
    x = torch.zeros(256)
    x[0:4] = torch.tensor([3.0, 1.0, -0.5, 17 / 128])  # block 0: amax 3 -> scale 2^-7
    x[64] = 0.1                                          # block 1: amax 0.1 -> scale 2^-12
    # block 2 all zero: amax floored at 1e-4 -> scale 2^-22
    x[192:196] = torch.tensor([1.0, -2.0, 0.5, 3.140625])  # rope: exact in bf16
    q = kv_fp8_quantize(x.to(dtype)[None], 64)[0]
    assert q.dtype == torch.uint8 and q.shape == (328,)

    assert [_fp8_scale_byte(a) for a in (3.0, 0.1, 0.0)] == [120, 115, 105]  # the oracle used below
    assert q[320:323].tolist() == [120, 115, 105]
    assert q[323:].tolist() == [0] * 5
    # e4m3 bytes: 3*2^7 = 384 = 1.5*2^8 -> 0x7C; 2^7 -> 0x70; -2^6 -> 0xE8; 17 ties between 16 and 18 -> even
    # mantissa, 16 -> 0x58; 0.1*2^12 = 409.6 -> 416 = 1.625*2^8 -> 0x7D
    assert q[0:5].tolist() == [0x7C, 0x70, 0xE8, 0x58, 0x00]
    assert q[5:64].tolist() == [0] * 59
    assert q[64] == 0x7D and q[65:192].tolist() == [0] * 127
    # rope: little-endian bf16 bits 0x3F80, 0xC000, 0x3F00, 0x4049, then zeros
    assert q[192:200].tolist() == [0x80, 0x3F, 0x00, 0xC0, 0x00, 0x3F, 0x49, 0x40]
    assert q[200:320].tolist() == [0] * 120


def test_fp8_rope_bytes_are_bf16_bits():
    x = torch.randn(5, 128)
    q = kv_fp8_quantize(x, 64)
    assert torch.equal(q[:, 64:192], x[:, 64:].to(torch.bfloat16).view(torch.uint8))
    amax = x[:, :64].abs().amax(-1)
    assert q[:, 192].tolist() == [_fp8_scale_byte(a) for a in amax.tolist()]
    assert q[:, 193:].eq(0).all()  # one scale byte, seven pad bytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_round_trip_equals_fake_quant(dtype):
    x, rope_dim = kv_fp8_quantize_inputs("cpu", dtype, n_rows=64, seed=3)
    y = kv_fp8_dequantize(kv_fp8_quantize(x, rope_dim), x.shape[-1], rope_dim, dtype)
    torch.testing.assert_close(y, kv_fp8_fake_quant(x, rope_dim), rtol=0, atol=0)
    # leading dims pass through
    x3 = x.reshape(4, 16, -1)
    y3 = kv_fp8_dequantize(kv_fp8_quantize(x3, rope_dim), x.shape[-1], rope_dim, dtype)
    torch.testing.assert_close(y3, y.reshape(4, 16, -1), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ FP4 rows
def test_fp4_row_bytes():
    assert kv_quant.fp4_row_bytes(128) == 64 + 4 == 68
    with pytest.raises(ValueError, match="power-of-two width divisible by 32, got 96"):
        kv_quant.fp4_row_bytes(96)  # not a power of two


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp4_codes_by_hand(dtype):
    # block 0 holds 6.0, so its scale is 2^ceil(log2(6/6)) = 1 (byte 127) and values are the codes' own
    ties = [0.25, -0.25, 0.75, -0.75, 1.25, -1.25, 1.75, -1.75, 2.5, -2.5, 3.5, -3.5, 5.0, -5.0]
    # round to nearest even code: 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (2), 1.75 -> 2 (4),
    # 2.5 -> 2 (4), 3.5 -> 4 (6), 5 -> 4 (6); the sign is bit 3 (sign-magnitude, so -0.25 -> -0 = code 8)
    tie_codes = [0, 8, 2, 10, 2, 10, 4, 12, 4, 12, 6, 14, 6, 14]
    exact = [6.0, -6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -4.0]
    exact_codes = [7, 15, 0, 1, 2, 3, 4, 5, 6, 14]
    near = [0.26, 2.51]  # just past a tie: rounds up to 0.5 (code 1) and 3 (code 5)
    near_codes = [1, 5]
    block0 = ties + exact + near + [0.0] * 6
    codes0 = tie_codes + exact_codes + near_codes + [0] * 6
    # block 1: amax 0.75 -> scale 2^ceil(log2(0.125)) = 2^-3 (byte 124): 0.75 -> 6 (7), 0.1 -> 0.8 -> 1 (2),
    # -0.375 -> -3 (13)
    block1 = [0.75, 0.1, -0.375] + [0.0] * 29
    codes1 = [7, 2, 13] + [0] * 29
    x = torch.tensor([block0 + block1]).to(dtype)
    q = idx_fp4_quantize(x)[0]
    assert q.shape == (34,)
    codes = codes0 + codes1
    packed = [codes[2 * k] | (codes[2 * k + 1] << 4) for k in range(32)]  # low nibble = even element
    assert q[:32].tolist() == packed
    assert q[:4].tolist() == [0x80, 0xA2, 0xA2, 0xC4]
    assert q[32:].tolist() == [127, 124]
    values = [0.0, -0.0, 1.0, -1.0, 1.0, -1.0, 2.0, -2.0, 2.0, -2.0, 4.0, -4.0, 4.0, -4.0]
    y = idx_fp4_dequantize(q[None], 64, torch.float32)[0]
    assert y[:14].tolist() == values
    assert y[32:35].tolist() == [0.75, 0.125, -0.375]
    assert idx_fp4_fake_quant(x)[0, :14].tolist() == values  # the pure-torch fake quant rounds the same way


def test_fp4_zero_block_scale():
    # amax floored at 6 * 2^-126: scale 2^-126, byte 1; all codes 0
    q = idx_fp4_quantize(torch.zeros(1, 32))[0]
    assert q.tolist() == [0] * 16 + [1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp4_round_trip_equals_fake_quant(dtype):
    (x,) = idx_fp4_quantize_inputs("cpu", dtype, n_rows=64, seed=4)
    y = idx_fp4_dequantize(idx_fp4_quantize(x), x.shape[-1], dtype)
    torch.testing.assert_close(y, idx_fp4_fake_quant(x), rtol=0, atol=0)
    # values sitting exactly on the ties of the scaled grid
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    t = grid[torch.randint(0, 8, (16, 128), generator=torch.Generator().manual_seed(5))]
    t = (t * torch.where(torch.rand(16, 128, generator=torch.Generator().manual_seed(6)) < 0.5, -1.0, 1.0)).to(dtype)
    t[:, ::32] = 6.0  # every block's amax is 6: scale 1, so the ties stay ties
    torch.testing.assert_close(idx_fp4_dequantize(idx_fp4_quantize(t), 128, dtype), idx_fp4_fake_quant(t),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp4_fake_quant_equals_nearest_code_search(dtype):
    """The arithmetic rounding (round-half-even of |y| / step) against a search of the 8 magnitudes for the nearest,
    ties to the even code: grid points, ties and near-ties in every span, both signs, zeros, block scales from
    subnormal to 2^100."""
    from dsv4rt.ops.kv_quant import FP4_AMAX_FLOOR, FP4_MAX, _e2m1_magnitude, _pow2_scale

    def search(x):
        xb = x.float().reshape(*x.shape[:-1], -1, 32)
        scale = _pow2_scale(xb.abs().amax(-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR), FP4_MAX)
        y = xb / scale
        code = torch.arange(8)
        dist = (y.abs().unsqueeze(-1) - _e2m1_magnitude(code)).abs()
        rank = torch.where(dist == dist.min(-1, keepdim=True).values, code + 8 * (code % 2), 100)
        return (torch.copysign(_e2m1_magnitude(code)[rank.argmin(-1)], y) * scale).reshape(x.shape).to(x.dtype)

    g = torch.Generator().manual_seed(7)
    pts = torch.tensor([0, .2499, .25, .26, .5, .75, 1, 1.25, 1.5, 1.75, 1.9999, 2, 2.5, 2.51, 3, 3.5, 4, 4.0001, 5,
                        5.5, 5.999, 6])
    for _ in range(20):
        y = pts[torch.randint(0, pts.numel(), (32, 4, 32), generator=g)]
        y = y * torch.where(torch.rand(32, 4, 32, generator=g) < 0.5, -1.0, 1.0)
        y[:, :, 0] = 6.0  # the block's amax: its scale is 2^e exactly, so ties stay ties
        x = (y * torch.exp2(torch.randint(-125, 100, (32, 4, 1), generator=g).float())).reshape(32, 128)
        r = torch.randn(32, 128, generator=g) * torch.exp2(torch.randint(-135, 100, (32, 1), generator=g).float())
        for t in (x, r, torch.zeros(2, 128), -torch.zeros(2, 128)):
            t = t.to(dtype)
            want, got = search(t), idx_fp4_fake_quant(t)
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


# ------------------------------------------------------------------------------------------ Hadamard
def test_hadamard_sylvester_order():
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float32) / 2
    torch.testing.assert_close(hadamard(torch.eye(4)), h4, rtol=0, atol=0)
    x = torch.randn(3, 4)
    torch.testing.assert_close(hadamard(x), x @ h4.t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [2, 32, 128])
def test_hadamard_orthonormal(n):
    h = hadamard(torch.eye(n))
    torch.testing.assert_close(h @ h.t(), torch.eye(n), rtol=0, atol=1e-6)
    torch.testing.assert_close(h, h.t(), rtol=0, atol=0)  # Sylvester matrices are symmetric
