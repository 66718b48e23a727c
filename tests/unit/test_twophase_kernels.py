"""The two-phase reducer through the fused CPU kernels and through the codecs' array ops: the
same bytes on the wire, the same results and residuals, step after step (simulated workers)."""
import numpy as np
import pytest

from hvdp import codecs
from hvdp.reduce.collectives import AVERAGE, SUM
from hvdp.kernels.base import Unavailable
from hvdp.kernels.build import find_compiler
from hvdp.ops import NumpyOps
from hvdp.reduce.simcomm import FakeGroup
from hvdp.reduce.stats import WireStats
from hvdp.reduce.twophase import TwoPhaseReducer

OPS = NumpyOps()
try:
    find_compiler()
except Unavailable as e:
    pytest.skip(f"no C compiler: {e}", allow_module_level=True)


class HostCopyOps(NumpyOps):
    """Like TensorFlow's eager tensors: arrays are never written in place, only copied to the
    host and wrapped back (every array it hands out is read-only, so a write would raise)."""
    writable_views = False

    def as_numpy(self, x):
        return np.array(x)

    def from_numpy(self, a, like=None):
        out = np.array(a)
        out.setflags(write=False)
        return out


def run(p, codec, ef, steps, grads, monkeypatch, kernels, op=AVERAGE, postscale=1.0, ops=OPS):
    """Every step's results, wire buffers and residuals of P simulated workers."""
    monkeypatch.setenv("HVDP_KERNELS", "auto" if kernels else "off")
    g = FakeGroup(p)
    stats = [WireStats() for _ in range(p)]
    rs = [TwoPhaseReducer(codec, ops, c, ef, op, postscale, stats=s) for c, s in zip(g.comms, stats)]
    history = []
    for step in range(steps):
        g.board.clear()
        pend = [r.start("b0", ops.from_numpy(grads[step][i].copy())) for i, r in enumerate(rs)]
        for r, pe in zip(rs, pend):
            r.exchange(pe)
        outs = [r.finish(pe) for r, pe in zip(rs, pend)]
        for s in stats:
            s.end_step()
        wire = {k: {rank: v.tobytes() for rank, v in parts.items()} for k, parts in g.board.items()}
        history.append((outs, wire, [r.worker_residual for r in rs], [r.server_residual for r in rs]))
    want = ("cpu-c" if ops.writable_views else "cpu-c (host copies)") if kernels else "array ops"
    assert all(s.paths == {codec.name: want} for s in stats), [s.paths for s in stats]
    why = stats[0].summary()["paths_why"]
    assert why == ({} if kernels else {codec.name: "HVDP_KERNELS=off: the array ops run (unset it to use kernels)"})
    return history, stats


def bits(a):
    return np.asarray(a).view(np.uint32 if np.asarray(a).dtype == np.float32 else np.uint8)


def assert_rolled_back(*histories):
    """Step 1 (non-finite) left every rank's residuals as step 0 made them, on every path."""
    for h in histories:
        for r0, r1 in zip(h[0][2] + h[0][3], h[1][2] + h[1][3]):
            assert r0.keys() == r1.keys() == {"b0"}
            np.testing.assert_array_equal(bits(r0["b0"]), bits(r1["b0"]))


def grads_for(p, n, steps, seed, nonfinite=False):
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        row = [(rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32) for _ in range(p)]
        if nonfinite and s == 1:
            row[0][n // 3] = np.inf
            row[-1][n // 2] = np.nan
        out.append(row)
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("codec", ["int8:64", "int8:256", "bf16", "int4:64", "int4:128"])
def test_kernel_path_equals_array_ops(p, ef, codec, monkeypatch):
    name, _, block = codec.partition(":")
    c = codecs.get(name, block_size=int(block)) if block else codecs.get(name)
    n, steps = 1000 + 37 * p, 4
    grads = grads_for(p, n, steps, seed=p * 10 + ef, nonfinite=(p == 3))
    ref, _ = run(p, c, ef, steps, grads, monkeypatch, kernels=False)
    got, stats = run(p, c, ef, steps, grads, monkeypatch, kernels=True)
    for step, ((o1, w1, wr1, sr1), (o2, w2, wr2, sr2)) in enumerate(zip(ref, got)):
        assert w1 == w2, f"step {step}: different bytes on the wire"
        for a, b in zip(o1, o2):
            assert a.shape == (n,)
            np.testing.assert_array_equal(bits(a), bits(b))
        for r1, r2 in zip(wr1 + sr1, wr2 + sr2):
            assert r1.keys() == r2.keys() == ({"b0"} if ef else set())
            for k in r1:
                np.testing.assert_array_equal(bits(r1[k]), bits(r2[k]))
    if p == 3:  # the non-finite step really sent NaN through, on both paths
        assert np.isnan(ref[1][0][0]).any() and np.isnan(got[1][0][0]).any()
    if p == 3 and ef:
        assert_rolled_back(ref, got)
    phases = stats[0].summary()["phase_ms"]
    assert set(phases) == {"encode", "wire_wait", "owner", "final_decode"}
    assert phases["encode"] > 0 and phases["owner"] > 0 and phases["final_decode"] > 0
    assert (phases["wire_wait"] > 0) == (p > 1)


def test_sum_op_postscale_and_old_snapshot_stay_valid(monkeypatch):
    c = codecs.get("int8", block_size=128)
    grads = grads_for(2, 999, 3, seed=7)
    ref, _ = run(2, c, True, 3, grads, monkeypatch, kernels=False, op=SUM, postscale=0.5)
    got, _ = run(2, c, True, 3, grads, monkeypatch, kernels=True, op=SUM, postscale=0.5)
    for (o1, w1, wr1, _), (o2, w2, wr2, _) in zip(ref, got):
        assert w1 == w2
        np.testing.assert_array_equal(bits(o1[0]), bits(o2[0]))
    # residual snapshots of step 1 were not overwritten by later steps (new buffer per step)
    assert not np.array_equal(got[0][2][0]["b0"], got[2][2][0]["b0"])
    np.testing.assert_array_equal(bits(got[0][2][0]["b0"]), bits(ref[0][2][0]["b0"]))


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("codec", ["int8", "bf16", "int4"])
def test_host_copies_path_equals_array_ops(p, ef, codec, monkeypatch):
    """Read-only framework arrays (TF eager): kernels on host copies, the reference's bits."""
    c = codecs.get(codec)
    n, steps = 900 + 53 * p, 3
    grads = grads_for(p, n, steps, seed=p + 100 * ef, nonfinite=(p == 3))
    ref, _ = run(p, c, ef, steps, grads, monkeypatch, kernels=False)
    got, _ = run(p, c, ef, steps, grads, monkeypatch, kernels=True, ops=HostCopyOps())
    for step, ((o1, w1, wr1, sr1), (o2, w2, wr2, sr2)) in enumerate(zip(ref, got)):
        assert w1 == w2, f"step {step}: different bytes on the wire"
        for a, b in zip(o1, o2):
            np.testing.assert_array_equal(bits(a), bits(b))
        for r1, r2 in zip(wr1 + sr1, wr2 + sr2):
            assert r1.keys() == r2.keys()
            for k in r1:
                np.testing.assert_array_equal(bits(r1[k]), bits(r2[k]))
    if p == 3 and ef:
        assert_rolled_back(ref, got)


def test_reducer_keeps_array_ops_where_no_kernel(monkeypatch):
    monkeypatch.setenv("HVDP_KERNELS", "auto")
    g = FakeGroup(2)
    topk = TwoPhaseReducer(codecs.get("topk"), OPS, g.comms[0], True)
    assert topk.kernels_for(np.zeros(4, np.float32)) is None

    class TracedOps(NumpyOps):  # like TF while a graph is traced: no data to copy to the host
        writable_views = False

        def as_numpy(self, x):
            return None

    s = WireStats()
    r = TwoPhaseReducer(codecs.get("int8"), TracedOps(), g.comms[0], True, stats=s)
    assert r.kernels_for(np.zeros(4, np.float32)) is None
    assert s.paths == {"int8": "array ops"} and "give no host copy here" in s.paths_why["int8"]
    assert TwoPhaseReducer(codecs.get("int8"), HostCopyOps(), g.comms[0], True).kernels_for(
        np.zeros(4, np.float32)) is not None
