"""Every codec against the numpy reference and against its own error bound."""
import math

import numpy as np
import pytest

from hvdp import codecs
from hvdp.ops import NumpyOps

OPS = NumpyOps()
RNG = np.random.default_rng(0)


def roundtrip(codec, x):
    payload = codec.encode(OPS, x)
    assert payload.dtype == np.uint8
    assert payload.size == codec.payload_nbytes(x.size)
    return codec.decode(OPS, payload, x.size)


def int8_reference(x, block):
    """Independent, straight-line numpy statement of blockwise absmax int8."""
    xb = x.reshape(-1, block).astype(np.float64)
    s = np.abs(xb).max(axis=1, keepdims=True) / 127.0
    q = np.clip(np.rint(np.divide(xb, s, out=np.zeros_like(xb), where=s > 0)), -127, 127)
    return (q * s).ravel()


@pytest.mark.parametrize("block", [4, 64, 256])
def test_int8_matches_reference_and_half_step_bound(block):
    x = (RNG.standard_normal(block * 37) * RNG.uniform(1e-4, 10, block * 37)).astype(np.float32)
    codec = codecs.get("int8", block_size=block)
    y = roundtrip(codec, x)
    ref = int8_reference(x, block)
    step = np.repeat(np.abs(x.reshape(-1, block)).max(axis=1) / 127.0, block)
    # float32 arithmetic vs the float64 statement: equal to float32 precision, except that an
    # exact .5 tie may round the other way (one step) -- rare, so bounded by count
    close = np.isclose(y, ref, rtol=1e-6, atol=1e-6 * step.max())
    assert np.mean(close) > 0.999, np.mean(close)
    err = np.abs(y.astype(np.float64) - x)
    assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-30), float((err / step).max())


def test_int8_zero_block_and_nonfinite_positions():
    codec = codecs.get("int8", block_size=8)
    x = np.zeros(24, np.float32)
    x[8:16] = np.arange(8) - 3.5
    x[10], x[12], x[20] = np.inf, np.nan, -np.inf
    y = roundtrip(codec, x)
    assert np.all(y[:8] == 0)
    assert np.isnan(y[10]) and np.isnan(y[12]) and np.isnan(y[20])
    finite = np.isfinite(x)
    assert np.all(np.isfinite(y[finite]))
    # the inf did not blow up the scale of the finite neighbours
    np.testing.assert_allclose(y[finite], x[finite], atol=3.5 / 254 * 1.0001)


def test_int8_block_size_validated():
    with pytest.raises(ValueError, match="multiple of 4"):
        codecs.get("int8", block_size=6)


def int4_reference(x, block):
    """Independent numpy statement of int4: codes and payload bytes by integer bit operations."""
    n = x.size
    xb = x.reshape(-1, block).astype(np.float32)
    s = np.abs(xb).max(axis=1, keepdims=True) / np.float32(7.0)
    q = np.clip(np.rint(np.divide(xb, s, out=np.zeros_like(xb), where=s > 0)), -7, 7).astype(np.int64)
    nib = (q.ravel() + 8).astype(np.uint8)
    packed = nib[:n // 2] | (nib[n // 2:] << 4)
    return (q.astype(np.float32) * s).ravel(), np.concatenate([packed, s.ravel().astype(np.float32).view(np.uint8)])


@pytest.mark.parametrize("block", [4, 64, 128])
def test_int4_matches_reference_and_half_step_bound(block):
    codec = codecs.get("int4", block_size=block)
    n = codec.align * 19
    x = (RNG.standard_normal(n) * RNG.uniform(1e-4, 10, n)).astype(np.float32)
    payload = codec.encode(OPS, x)
    ref_y, ref_bytes = int4_reference(x, block)
    assert payload.size == codec.payload_nbytes(n) == n // 2 + 4 * n // block
    np.testing.assert_array_equal(payload, ref_bytes)  # same float32 arithmetic: same bytes
    y = codec.decode(OPS, payload, n)
    np.testing.assert_array_equal(y, ref_y)
    step = np.repeat(np.abs(x.reshape(-1, block)).max(axis=1) / 7.0, block)
    err = np.abs(y.astype(np.float64) - x)
    assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-30), float((err / step).max())
    # never above the block's absmax by more than the rounding of 7 * (absmax / 7)
    assert np.all(np.abs(y) <= np.repeat(np.abs(x.reshape(-1, block)).max(axis=1), block) * (1 + 2**-22))


def test_int4_zero_block_nonfinite_and_extremes():
    codec = codecs.get("int4", block_size=8)
    x = np.zeros(32, np.float32)
    x[8:16] = np.arange(8) - 3.5
    x[10], x[12], x[20] = np.inf, np.nan, -np.inf
    x[24:32] = [3e38, -3e38, 1e-40, -1e-40, 1.0, -1.0, 0.0, 7.0]
    y = roundtrip(codec, x)
    assert np.all(y[:8] == 0)
    assert np.isnan(y[10]) and np.isnan(y[12]) and np.isnan(y[20])
    assert np.isnan(y).sum() == 3
    finite = np.isfinite(x)
    assert np.all(np.isfinite(y[finite]))
    # the inf did not blow up the scale of its block's finite neighbours
    np.testing.assert_allclose(y[8:16][finite[8:16]], x[8:16][finite[8:16]], atol=3.5 / 14 * 1.0001)
    np.testing.assert_allclose(y[24:26], [3e38, -3e38], rtol=1e-6)  # no overflow at the top
    # a block of subnormals keeps its sign and bound
    z = np.array([1e-40, -3e-41, 0, 2e-45] * 4, np.float32)
    yz = roundtrip(codec, z)
    assert np.all(np.abs(yz.astype(np.float64) - z) <= np.abs(z).max() / 14 * 1.0001 + 1e-45)


def test_int4_block_size_validated_and_wire_ratio():
    with pytest.raises(ValueError, match="multiple of 4"):
        codecs.get("int4", block_size=6)
    c = codecs.get("int4")
    assert c.block_size == 128 and c.align == 256 and c.error_feedback_default
    assert c.payload_nbytes(1 << 20) / (4 << 20) == pytest.approx(0.5 / 4 + 1 / 128)
    assert codecs.Compression.int4 == c


@pytest.mark.parametrize("name,dtype", [("fp16", np.float16), ("none", np.float32)])
def test_cast_codecs_equal_numpy_cast(name, dtype):
    x = RNG.standard_normal(1000).astype(np.float32) * 100
    np.testing.assert_array_equal(roundtrip(codecs.get(name), x), x.astype(dtype).astype(np.float32))


def bf16_reference(x):
    """Round to nearest even on the upper 16 bits, computed in Python integers."""
    out = []
    for v in x.astype(np.float32).view(np.uint32).tolist():
        upper, lower = v >> 16, v & 0xFFFF
        if lower > 0x8000 or (lower == 0x8000 and upper & 1):
            upper += 1
        out.append(upper << 16)
    return np.array(out, dtype=np.uint32).view(np.float32)


def test_bf16_round_to_nearest_even_and_relative_error():
    x = np.concatenate([RNG.standard_normal(2000).astype(np.float32) * 1e3,
                        np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 3e38, 1e-40], np.float32)])
    y = roundtrip(codecs.get("bf16"), x)
    np.testing.assert_array_equal(y, bf16_reference(x))
    normal = np.abs(x) > 1e-37
    assert np.all(np.abs(y[normal] - x[normal]) <= np.abs(x[normal]) * 2**-8)


def test_bf16_nonfinite_kept():
    x = np.array([np.inf, -np.inf, np.nan, 1.0], np.float32)
    y = roundtrip(codecs.get("bf16"), x)
    assert y[0] == np.inf and y[1] == -np.inf and np.isnan(y[2]) and y[3] == 1.0


@pytest.mark.parametrize("ratio", [0.01, 0.1, 1.0])
def test_topk_keeps_k_largest(ratio):
    x = RNG.standard_normal(5000).astype(np.float32)
    codec = codecs.get("topk", ratio=ratio)
    y = roundtrip(codec, x)
    k = codec.k(x.size)
    assert k == min(x.size, max(1, math.ceil(ratio * x.size)))
    keep = np.argsort(-np.abs(x))[:k]
    ref = np.zeros_like(x)
    ref[keep] = x[keep]
    np.testing.assert_array_equal(y, ref)


def test_topk_carries_nonfinite_first():
    x = RNG.standard_normal(100).astype(np.float32)
    x[7], x[50] = np.nan, -np.inf
    y = roundtrip(codecs.get("topk", ratio=0.02), x)
    assert np.isnan(y[7]) and y[50] == -np.inf
    assert np.count_nonzero(y[np.isfinite(y)]) == 0


def test_topk_ratio_validated():
    with pytest.raises(ValueError, match="ratio"):
        codecs.get("topk", ratio=0)


def test_registry_errors_name_the_fix():
    with pytest.raises(ValueError, match="valid names: bf16, fp16, int4, int8, none, "):
        codecs.get("int3")
    with pytest.raises(ValueError, match="already registered"):
        @codecs.register
        class Again(codecs.Codec):
            name = "int8"
    with pytest.raises(ValueError, match="takes"):
        codecs.get("int8", bits=4)
    assert str(codecs.get("topk", ratio=0.05)) == "topk(ratio=0.05)"
