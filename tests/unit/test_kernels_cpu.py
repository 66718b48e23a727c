"""The CPU codec kernels (hvdp/kernels/cpu_codecs.c) against the numpy reference codecs, their
selection (HVDP_KERNELS, no compiler) and the two-phase reducer through both paths."""
import numpy as np
import pytest

from hvdp import codecs
from hvdp.kernels import registry
from hvdp.kernels.base import Unavailable
from hvdp.kernels.build import find_compiler
from hvdp.ops import NumpyOps

OPS = NumpyOps()
try:
    find_compiler()
    HAVE_CC = True
except Unavailable:
    HAVE_CC = False
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernels cannot be built")


def kernels(codec):
    k, why = registry.explain(codec, OPS, np.zeros(1, np.float32))
    assert k is not None, why
    assert k.path == "cpu-c"
    return k


def data(n, seed, block=256, nonfinite=False, zero_block=False, tiny=False):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-12, 8, n))).astype(np.float32)
    if nonfinite:
        idx = rng.choice(n, size=max(3, n // 300), replace=False)
        x[idx[0::3]], x[idx[1::3]], x[idx[2::3]] = np.inf, -np.inf, np.nan
        if n >= 3 * block:
            x[block:2 * block] = rng.choice(np.float32([np.inf, -np.inf, np.nan]), block)
    if zero_block and n >= 2 * block:
        x[:block] = 0.0
    if tiny and n >= 2 * block:  # a block whose scale is a subnormal float (codes may wrap)
        x[-block:] = np.float32(2.0 ** -142) * rng.uniform(-1, 1, block).astype(np.float32)
        x[-block] = np.float32(2.0 ** -142)
    return x


def same(a, b):
    """Bit-identical floats, except that any NaN equals any NaN (their payloads may differ)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    if a.dtype != np.float32:
        np.testing.assert_array_equal(a, b)
        return
    na, nb = np.isnan(a), np.isnan(b)
    assert (na == nb).all(), f"NaN at different places: {np.flatnonzero(na != nb)[:5]}"
    bad = np.flatnonzero(a[~na].view(np.uint32) != b[~nb].view(np.uint32))
    assert bad.size == 0, f"{bad.size} values differ, first {a[~na][bad[:3]]} vs {b[~nb][bad[:3]]}"


def reference_encode(codec, x, prev=None):
    """The reducer's array-op path: y = x + prev, payload, residual = finite_or_zero(y - decode)."""
    y = x + prev if prev is not None else x
    payload = codec.encode(OPS, y)
    with np.errstate(invalid="ignore"):
        r = y - codec.decode(OPS, payload, y.size)
    return payload, np.where(np.isfinite(r), r, 0.0).astype(np.float32)


CODECS = [("int8", b) for b in (64, 128, 256, 1024, 4096)] + [("int8", 36), ("bf16", 0), ("fp16", 0)] + \
    [("int4", b) for b in (64, 128, 256, 8192)] + [("int4", 36)]  # 8192: the kernel's heap path


def make_codec(name, block):
    return codecs.get(name, block_size=block) if block else codecs.get(name)


def unit(codec, block, cast=64):
    """A chunk length's step: the codec's alignment (int4: two blocks), ``cast`` for the casts."""
    return codec.align if block else cast


@needs_cc
@pytest.mark.parametrize("name,block", CODECS)
@pytest.mark.parametrize("nblocks", [1, 3, 37])
@pytest.mark.parametrize("kind", ["plain", "nonfinite", "zero_block", "tiny"])
def test_encode_decode_match_reference(name, block, nblocks, kind):
    codec = make_codec(name, block)
    k = kernels(codec)
    n = nblocks * unit(codec, block) + (0 if block else 7)  # casts: any length
    x = data(n, seed=nblocks * 7 + block, block=block or 64, **({kind: True} if kind != "plain" else {}))
    x0 = x.copy()
    want = codec.encode(OPS, x)
    got = k.encode(x)
    same(got, want)
    same(x, x0)  # input untouched
    same(k.decode(got, n), codec.decode(OPS, want, n))
    out = np.full(n, 7.0, np.float32)
    assert k.decode(got, n, out=out) is out
    same(out, codec.decode(OPS, want, n))
    buf = np.zeros(codec.payload_nbytes(n) + 8, np.uint8)
    assert k.encode(x, out=buf[4:-4]).base is not None
    same(buf[4:-4], want)
    assert not buf[:4].any() and not buf[-4:].any()  # nothing written outside out


@needs_cc
@pytest.mark.parametrize("name,block", CODECS)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_error_feedback_residual_matches_reference(name, block, nonfinite):
    codec = make_codec(name, block)
    k = kernels(codec)
    n = 5 * unit(codec, block)
    x = data(n, 3, block or 64, nonfinite=nonfinite, tiny=nonfinite)
    prev = data(n, 4, block or 64) * np.float32(0.01)
    res = np.full(n, np.nan, np.float32)
    want, want_r = reference_encode(codec, x, prev)
    p0 = prev.copy()
    same(k.encode(x, prev=prev, residual=res), want)
    same(res, want_r)
    same(prev, p0)
    res2 = np.empty(n, np.float32)  # without prev: residual of x alone
    want, want_r = reference_encode(codec, x)
    same(k.encode(x, residual=res2), want)
    same(res2, want_r)
    same(k.encode(x, prev=prev), reference_encode(codec, x, prev)[0])


@needs_cc
@pytest.mark.parametrize("block", [64, 256, 4096])
def test_quotients_at_and_near_half_integers_round_like_the_reference(block):
    """Blocks built so that y / scale is exactly k + 1/2 (ties to even), a few ulp either side of
    it, or random: the kernel's codes and residuals are the reference's. (A kernel that multiplied
    by the reciprocal instead of dividing would fail here: the two round apart near ties. Tried:
    a multiply with a division fallback near ties was slower, 0.99 against 0.84 ms per 16 MiB.)"""
    codec = codecs.get("int8", block_size=block)
    k = kernels(codec)
    rng = np.random.default_rng(block)
    blocks = []
    for b in range(60):
        scale = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-30, 30))
        # the odd scale multiples of 3 make 1/scale inexact, so products and quotients differ
        scale = np.float32(3 * scale) if b % 2 else scale
        half = (rng.integers(-127, 127, block) + np.float32(0.5)).astype(np.float32)
        y = (half * scale).astype(np.float32)
        if b % 3 == 1:  # a few ulp off the tie, either side
            y = (y.view(np.int32) + rng.integers(-3, 4, block).astype(np.int32)).view(np.float32)
        if b % 3 == 2:  # only some elements near ties
            y = np.where(rng.random(block) < 0.1, y, (rng.uniform(-127, 127, block) * scale)).astype(np.float32)
        y[0] = np.float32(127) * scale  # absmax: the block's scale is `scale` (up to rounding)
        blocks.append(y)
    x = np.concatenate(blocks)
    want = codec.encode(OPS, x)
    same(k.encode(x), want)
    res = np.empty_like(x)
    same(k.encode(x, residual=res), want)
    same(res, reference_encode(codec, x)[1])
    # the data reach the cases meant: quotients that round differently by product and by division
    scales = np.frombuffer(want[x.size:].tobytes(), np.float32)
    q = x.reshape(-1, block) / scales[:, None]
    t = x.reshape(-1, block) * (np.float32(1) / scales[:, None])
    assert (np.rint(q) != np.rint(t)).sum() > 0


def test_tiny_scale_clips_instead_of_wrapping_like_reference():
    """A block with a subnormal scale: the quotient can round to 128, which is clipped to 127 (it
    once wrapped to -128: a sign flip), with or without a non-finite value elsewhere in the chunk."""
    if not HAVE_CC:
        pytest.skip("no C compiler")
    codec = codecs.get("int8", block_size=64)
    k = kernels(codec)
    x = np.zeros(3 * 64, np.float32)
    x[:64] = np.float32(2.0 ** -142)  # scale 2^-149: quotient 128
    want = codec.encode(OPS, x)
    assert np.frombuffer(want[:64].tobytes(), np.int8)[0] == 127
    assert codec.decode(OPS, want, x.size)[0] > 0  # the sign survives
    same(k.encode(x), want)
    x[150] = np.inf
    x[140] = x[70] = np.float32(-2.0 ** -142)  # quotient -128 in a flagged and in a clean block
    want = codec.encode(OPS, x)
    codes = np.frombuffer(want[:192].tobytes(), np.int8)
    assert codes[0] == 127 and codes[70] == -127 and codes[140] == -127 and codes[150] == -128  # clipped
    res = np.empty_like(x)
    same(k.encode(x, residual=res), want)
    same(res, reference_encode(codec, x)[1])


@needs_cc
@pytest.mark.parametrize("name,block", [("int8", 64), ("int8", 256), ("int8", 4096), ("bf16", 0), ("fp16", 0),
                                        ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("scale", [1.0, 0.25, 1.0 / 3])
def test_decode_sum_matches_reducer_loop(name, block, p, scale):
    codec = make_codec(name, block)
    k = kernels(codec)
    n = 3 * unit(codec, block, 100)
    payloads = [codec.encode(OPS, data(n, 10 * p + j, block or 64, nonfinite=(j == 1))) for j in range(p)]
    acc = None
    for pl in payloads:  # the reducer's exchange: add_ in rank order, then mul_
        part = codec.decode(OPS, pl, n)
        acc = part if acc is None else OPS.add_(acc, part)
    if scale != 1.0:
        acc = OPS.mul_(acc, scale)
    same(k.decode_sum(np.concatenate(payloads), p, n, scale), acc)


@needs_cc
def test_random_bit_patterns_16bit_casts():
    """Every kind of float32 (subnormals, overflow, NaN payloads) and every 16-bit pattern."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edge = np.float32([65504, 65519.99, 65520, 65536, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 2 ** -14,
                       2 ** -14 - 2 ** -25, -0.0, 0.0, np.inf, -np.inf, 3.4028235e38])
    x = np.concatenate([x, edge, -edge])
    every = np.arange(2 ** 16, dtype=np.uint16)
    for name in ("bf16", "fp16"):
        codec = codecs.get(name)
        k = kernels(codec)
        same(k.encode(x), codec.encode(OPS, x))
        pl = every.view(np.uint8)
        same(k.decode(pl, every.size), codec.decode(OPS, pl, every.size))


def test_hvdp_kernels_off_forces_array_ops(monkeypatch):
    monkeypatch.setenv("HVDP_KERNELS", "off")
    k, why = registry.explain(codecs.get("int8"), OPS, np.zeros(4, np.float32))
    assert k is None and "HVDP_KERNELS=off" in why[0]
    monkeypatch.setenv("HVDP_KERNELS", "fast")
    with pytest.raises(ValueError, match="HVDP_KERNELS='fast' is not one of auto, off"):
        registry.select(codecs.get("int8"), OPS, np.zeros(4, np.float32))


def test_missing_compiler_falls_back_with_reason(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/hvdp-cc")
    k, why = registry.explain(codecs.get("int8", block_size=128), OPS, np.zeros(4, np.float32))
    assert k is None
    assert any("cpu-c: no C compiler: CC='/nonexistent/hvdp-cc' is not an executable" in w for w in why), why


def test_broken_compiler_falls_back_with_reason(monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'fakecc 1.0'; exit 0; }\n"
                  "echo 'fakecc: cannot' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    k, why = registry.explain(codecs.get("bf16"), OPS, np.zeros(4, np.float32))
    assert k is None and any("failed (fakecc: cannot)" in w for w in why), why


def test_unserved_codec_and_device_say_why():
    k, why = registry.explain(codecs.get("topk"), OPS, np.zeros(4, np.float32))
    assert k is None and any("no CPU kernel for topk" in w for w in why), why
    k, why = registry.explain(codecs.get("int8"), OPS, [1.0, 2.0])  # not a host array of these ops
    assert k is None and any("not in host memory" in w for w in why), why
    k, why = registry.explain(codecs.get("int8"), OPS, np.zeros(4, np.float64))
    assert k is None and any("take float32 buckets, not float64" in w for w in why), why


def test_registry_order_duplicates_and_broken_provider():
    calls = []

    def first(codec, ops, like):
        calls.append("first")
        return None

    def broken(codec, ops, like):
        raise RuntimeError("boom")

    registry.register("test-first", first, first=True)
    registry.register("test-broken", broken, first=True)
    try:
        with pytest.raises(ValueError, match="already registered"):
            registry.register("test-first", first)
        k, why = registry.explain(codecs.get("topk"), OPS, np.zeros(4, np.float32))
        assert k is None and calls == ["first"]
        assert why[0] == "test-broken: failed (RuntimeError: boom)"
        assert why[1].startswith("test-first: does not serve topk")
    finally:
        registry.unregister("test-first")
        registry.unregister("test-broken")
    assert "test-first" not in registry.providers()


def test_doctor_names_the_path_and_why(monkeypatch):
    from hvdp.kernels.registry import kernel_paths
    # only the CPU backend: an adapter imported earlier in this process (hvdp.torch registers the
    # CUDA kernels) would add its own "not a CUDA tensor" reason to each line
    registry._load_builtin()
    monkeypatch.setattr(registry, "_PROVIDERS", [(n, p) for n, p in registry._PROVIDERS if n == "cpu-c"])
    lines = kernel_paths()
    assert lines[2] == "topk: array ops (cpu-c: no CPU kernel for topk (kernels exist for int8, int4, bf16, fp16))"
    if HAVE_CC:
        assert lines[0].startswith("int8: cpu-c kernel (") and "-O3" in lines[0]
    monkeypatch.setenv("CC", "/nonexistent/hvdp-cc")
    assert kernel_paths()[0].startswith("int8: array ops (cpu-c: no C compiler: CC='/nonexistent/hvdp-cc'")
    monkeypatch.setenv("HVDP_KERNELS", "off")
    assert kernel_paths()[1] == "bf16: array ops (HVDP_KERNELS=off: the array ops run (unset it to use kernels))"


@needs_cc
def test_two_ranks_building_at_once_share_one_cached_library(tmp_path):
    """Two processes compile into an empty cache together: both load a whole library, one file
    remains (each writes a private temporary name and renames it into place)."""
    import os
    import subprocess
    import sys
    code = ("from hvdp.kernels.cpu import load; import numpy as np; from hvdp import codecs; "
            "from hvdp.kernels.cpu import CpuKernels; from hvdp.ops import NumpyOps; lib, d = load(); "
            "k = CpuKernels(codecs.get('int8'), NumpyOps(), lib, d); x = np.ones(256, np.float32); "
            "print('OK', k.decode(k.encode(x), 256).sum())")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 and o.strip() == "OK 256.0" for p, (o, _) in zip(procs, outs)), outs
    libs = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert libs == ["libcpu_codecs.so"], libs
