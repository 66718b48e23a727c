"""The CUDA int8 and int4 kernels (adapters/torch/kernels_cuda.py) against the numpy reference codecs.

Runs on a CUDA device, or on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set here
when no GPU is present). Skipped where Triton is not installed (a CPU build of torch has none).
"""
import importlib.util
import os
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
# a CPU build of torch has no Triton: scripts/setup.sh puts one aside for these tests only
_aside = pathlib.Path(sys.prefix) / "hvdp-triton-path"
if importlib.util.find_spec("triton") is None and _aside.exists():
    sys.path.append(_aside.read_text().strip())
pytest.importorskip("triton")

from hvdp import codecs  # noqa: E402
from hvdp.ops import NumpyOps  # noqa: E402

_path = pathlib.Path(__file__).resolve().parents[2] / "adapters" / "torch" / "kernels_cuda.py"
_spec = importlib.util.spec_from_file_location("hvdp_kernels_cuda_under_test", _path)
kc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kc)  # by path: hvdp.torch's __init__ needs Horovod, the kernels do not

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NP = NumpyOps()


def _data(n, seed, nonfinite=False, zero_blocks=0, block=256):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.uniform(1e-6, 1e3, n)).astype(np.float32)
    if nonfinite:
        idx = rng.choice(n, size=max(3, n // 500), replace=False)
        x[idx[0::3]], x[idx[1::3]], x[idx[2::3]] = np.inf, -np.inf, np.nan
        x[:block] = np.nan if n >= 2 * block else x[:block]  # a block of non-finite values only
    for b in range(zero_blocks):
        x[(b + 1) * block:(b + 2) * block] = 0.0
    return x


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    assert (nan_a == nan_b).all(), "NaN positions differ"
    assert (a[~nan_a].view(np.uint32 if a.dtype == np.float32 else np.uint8)
            == b[~nan_b].view(np.uint32 if b.dtype == np.float32 else np.uint8)).all()


CASES = [(64, 64), (64, 64 * 37), (256, 256 * 5), (1024, 1024 * 9), (4096, 4096 * 3), (256, 256 * 129)]
NAMES = ["int8", "int4"]


def _kernels(name, block, n):
    """(codec, its CUDA kernels, a chunk length near n that the codec takes: int4 two blocks)."""
    codec = codecs.get(name, block_size=block)
    return codec, kc.KERNELS[name](codec), -(-n // codec.align) * codec.align


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block,n", CASES)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_encode_decode_match_reference(name, block, n, nonfinite):
    codec, k, n = _kernels(name, block, n)
    x = _data(n, seed=block + n, nonfinite=nonfinite, zero_blocks=2 if n >= 4 * block else 0, block=block)
    ref = codec.encode(NP, x)
    got = k.encode(_t(x)).cpu().numpy()
    np.testing.assert_array_equal(got, ref)
    _same(k.decode(_t(ref), n).cpu().numpy(), codec.decode(NP, ref, n))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("block,n", CASES[:5])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_encode_with_residual_matches_reference(name, block, n, nonfinite):
    """y = x + prev; payload = encode(y); residual = y - decode(payload), non-finite -> 0."""
    codec, k, n = _kernels(name, block, n)
    x = _data(n, seed=n, nonfinite=nonfinite, block=block)
    prev = (_data(n, seed=n + 1, block=block) * np.float32(1e-3)).astype(np.float32)
    y = x + prev
    ref = codec.encode(NP, y)
    dec = codec.decode(NP, ref, n)
    with np.errstate(invalid="ignore"):
        r = y - dec
    ref_res = np.where(np.isfinite(r), r, np.float32(0)).astype(np.float32)
    res = torch.empty(n, dtype=torch.float32, device=DEV)
    xt, pt = _t(x), _t(prev)
    got = k.encode(xt, prev=pt, residual=res).cpu().numpy()
    np.testing.assert_array_equal(got, ref)
    _same(res.cpu().numpy(), ref_res)
    _same(xt.cpu().numpy(), x)  # inputs untouched
    _same(pt.cpu().numpy(), prev)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
def test_decode_sum_matches_reference_loop(name, p, scale):
    block = 256
    codec, k, c = _kernels(name, block, 256 * 11)
    payloads = [codec.encode(NP, _data(c, seed=10 * p + j, nonfinite=(j == 1), block=block)) for j in range(p)]
    acc = None
    for pl in payloads:  # the reducer's order: the first part itself, then add_ in rank order
        part = codec.decode(NP, pl, c)
        acc = part if acc is None else NP.add_(acc, part)
    if scale != 1.0:
        acc = NP.mul_(acc, scale)
    got = k.decode_sum(_t(np.concatenate(payloads)), p, c, scale).cpu().numpy()
    _same(got, acc)


@pytest.mark.parametrize("name", NAMES)
def test_encode_into_a_send_buffer_slice(name):
    """Payloads written straight into their place in one send buffer (offset j * nbytes)."""
    codec, k, c = _kernels(name, 64, 64 * 3)
    p = 3
    nb = codec.payload_nbytes(c)
    send = torch.zeros(p * nb, dtype=torch.uint8, device=DEV)
    xs = [_data(c, seed=j, block=64) for j in range(p)]
    for j in range(p):
        k.encode(_t(xs[j]), out=send[j * nb:(j + 1) * nb])
    np.testing.assert_array_equal(send.cpu().numpy(), np.concatenate([codec.encode(NP, x) for x in xs]))


def test_subnormal_scale_clips_like_reference():
    """A block whose scale is a subnormal float: the quotient 128 is clipped to 127, not wrapped."""
    codec = codecs.get("int8", block_size=64)
    x = np.zeros(2 * 64, np.float32)
    x[:64] = np.float32(2.0 ** -142)
    ref = codec.encode(NP, x)
    assert np.frombuffer(ref[:1].tobytes(), np.int8)[0] == 127
    np.testing.assert_array_equal(kc.CudaInt8Kernels(codec).encode(_t(x)).cpu().numpy(), ref)


def test_int4_subnormal_scale_clips_like_reference():
    """int4: a block whose scale is a subnormal float keeps codes in [-7, 7] (no wrap to -8)."""
    codec = codecs.get("int4", block_size=64)
    x = np.zeros(4 * 64, np.float32)
    x[:64] = np.float32(2.0 ** -146)
    x[64:70] = -np.float32(2.0 ** -147) * np.arange(6, dtype=np.float32)
    ref = codec.encode(NP, x)
    np.testing.assert_array_equal(kc.KERNELS["int4"](codec).encode(_t(x)).cpu().numpy(), ref)
