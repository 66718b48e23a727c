"""The two-phase reduction on P simulated workers, against the exact float32 average."""
import numpy as np
import pytest

from hvdp.reduce.simcomm import FakeGroup
from hvdp import codecs
from hvdp.reduce.collectives import AVERAGE, SUM
from hvdp.ops import NumpyOps
from hvdp.reduce.stats import WireStats
from hvdp.reduce.twophase import TwoPhaseReducer, chunk_length

OPS = NumpyOps()


def reduce_all(reducers, grads, name="b0"):
    pend = [r.start(name, g) for r, g in zip(reducers, grads)]
    for r, p in zip(reducers, pend):
        r.exchange(p)
    return [r.finish(p) for r, p in zip(reducers, pend)]


def make(p, codec, ef=False, op=AVERAGE, stats=None, ops=OPS):
    g = FakeGroup(p)
    return [TwoPhaseReducer(codec, ops, c, ef, op, stats=stats) for c in g.comms]


QMAX = {"int8": 127, "int4": 7}  # a blockwise codec's largest code: its step is absmax / QMAX


def blockwise_bound(grads, out_mean, block, qmax):
    """Per element: the mean of each worker's half step, plus half a step of re-encoding."""
    n = grads[0].size
    pad = lambda v: np.concatenate([v, np.zeros(-n % block, np.float32)])  # noqa: E731
    step = lambda v: np.repeat(np.abs(pad(v).reshape(-1, block)).max(1) / qmax, block)[:n]  # noqa: E731
    return np.mean([step(g) for g in grads], axis=0) / 2 + step(out_mean) / 2


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 1000, 4099])
def test_blockwise_two_phase_within_derived_bound(name, p, n):
    rng = np.random.default_rng(p * 10000 + n)
    grads = [rng.standard_normal(n).astype(np.float32) * (r + 1) for r in range(p)]
    outs = reduce_all(make(p, codecs.get(name, block_size=64)), grads)
    exact = np.mean(grads, axis=0)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])  # every rank ends bit-identical
    assert outs[0].shape == (n,)
    bound = blockwise_bound(grads, outs[0], 64, QMAX[name])
    assert np.all(np.abs(outs[0] - exact) <= bound * (1 + 1e-4) + 1e-7)


@pytest.mark.parametrize("name,rtol", [("bf16", 2 ** -7), ("fp16", 2 ** -10), ("none", 1e-6)])
def test_float_codecs_two_phase_within_precision(name, rtol):
    rng = np.random.default_rng(1)
    grads = [rng.uniform(0.5, 2.0, 777).astype(np.float32) for _ in range(3)]
    outs = reduce_all(make(3, codecs.get(name)), grads)
    # each input and the reduced chunk rounded once: two relative roundings on positive data
    np.testing.assert_allclose(outs[0], np.mean(grads, axis=0), rtol=2.01 * rtol)


def test_sum_op_and_postscale():
    grads = [np.full(300, r + 1.0, np.float32) for r in range(2)]
    outs = reduce_all(make(2, codecs.get("bf16"), op=SUM), grads)
    np.testing.assert_array_equal(outs[0], np.full(300, 3.0, np.float32))


def test_nonfinite_reaches_every_rank_at_its_position():
    grads = [np.ones(512, np.float32) for _ in range(2)]
    grads[1][100] = np.inf
    reducers = make(2, codecs.get("int8"), ef=True)
    outs = reduce_all(reducers, grads)
    for o in outs:
        assert np.isnan(o[100]) and np.isfinite(np.delete(o, 100)).all()
        np.testing.assert_allclose(np.delete(o, 100), 1.0, rtol=1e-2)
    # the residuals stay finite, so the next (finite) step is clean again
    outs = reduce_all(reducers, [np.ones(512, np.float32)] * 2)
    assert np.isfinite(outs[0]).all()


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_error_feedback_keeps_accumulated_error_bounded(name):
    """Summed over T steps of the same gradient, EF's total error stays O(1); without EF it grows."""
    rng = np.random.default_rng(2)
    codec = codecs.get(name, **({"ratio": 0.05} if name == "topk" else {}))
    grads = [rng.standard_normal(2048).astype(np.float32) * 1e-3 for _ in range(2)]
    exact = np.mean(grads, axis=0)
    errs = {}
    for ef in (True, False):
        reducers = make(2, codec, ef=ef)
        acc = np.zeros_like(exact, dtype=np.float64)
        hist = []
        for t in range(1, 201):
            acc += reduce_all(reducers, grads)[0]
            hist.append(np.abs(acc - t * exact).max())
        errs[ef] = hist
    # with EF the accumulated error stays below a few steps' worth, not growing with T
    assert max(errs[True][100:]) <= 2.0 * max(errs[True][:100]) + 1e-9
    assert errs[True][-1] < errs[False][-1] / 10


def test_residual_state_roundtrip_and_layout_rule():
    reducers = make(2, codecs.get("int8"), ef=True)
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(2)]
    reduce_all(reducers, grads)
    state = reducers[0].state_dict()
    fresh = make(2, codecs.get("int8"), ef=True)
    fresh[0].load_state_dict(state)
    np.testing.assert_array_equal(fresh[0].worker_residual["b0"], reducers[0].worker_residual["b0"])
    np.testing.assert_array_equal(fresh[0].server_residual["b0"], reducers[0].server_residual["b0"])
    other_world = make(3, codecs.get("int8"), ef=True)
    other_world[0].load_state_dict(state)
    assert other_world[0].server_residual == {}  # the owned chunk moved: reset
    other_codec = make(2, codecs.get("int8", block_size=128), ef=True)
    other_codec[0].load_state_dict(state)
    assert other_codec[0].worker_residual == {}


def test_chunk_length_and_wire_stats():
    assert chunk_length(1000, 2, 256) == 512
    assert chunk_length(1, 4, 1) == 1
    for p in (2, 4, 8):
        stats = WireStats()
        reduce_all(make(p, codecs.get("int8"), stats=stats), [np.ones(2**16, np.float32)] * p)
        stats.end_step()
        ratio = stats.summary()["last_step"]["int8"]["ratio"]
        # each of the p simulated workers recorded its own bytes; the ratio is per worker
        assert ratio == pytest.approx((1 + 4 / 256) / 4, rel=1e-3)
        assert ratio <= 0.27
        stats = WireStats()
        reduce_all(make(p, codecs.get("int4"), stats=stats), [np.ones(2**16, np.float32)] * p)
        stats.end_step()
        assert stats.summary()["last_step"]["int4"]["ratio"] == pytest.approx((0.5 + 4 / 128) / 4, rel=1e-3)


def copies(reducers):
    """Every rank's (worker, server) residuals, copied."""
    return [({k: v.copy() for k, v in r.worker_residual.items()},
             {k: v.copy() for k, v in r.server_residual.items()}) for r in reducers]


def assert_same_residuals(a, b):
    for (wa, sa), (wb, sb) in zip(a, b):
        for x, y in ((wa, wb), (sa, sb)):
            assert x.keys() == y.keys()
            for k in x:
                np.testing.assert_array_equal(x[k].view(np.uint32), y[k].view(np.uint32))


class BlindOps(NumpyOps):
    """Like TensorFlow while a graph is traced: the fast-path guards cannot look at the data."""

    def all_finite(self, x):
        return False

    def all_nonnegative(self, x):
        return False


@pytest.mark.parametrize("ops", [OPS, BlindOps()], ids=["eager", "traced"])
@pytest.mark.parametrize("name", ["int8", "topk"])
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_step_with_nonfinite_result_leaves_no_trace_in_residuals(name, bad, ops):
    """A loss scaler skips a step whose reduced gradients are not finite; its residuals must then
    be as before the step on every rank, also on rank 1 whose own gradient was finite; the next
    finite step gives what a fresh reducer loaded with the residuals of before gives."""
    rng = np.random.default_rng(7)
    codec = codecs.get(name)
    grads = lambda: [rng.standard_normal(1000).astype(np.float32) for _ in range(2)]  # noqa: E731
    reducers = make(2, codec, ef=True, ops=ops)
    reduce_all(reducers, grads())  # residuals exist
    before = copies(reducers)
    state = [r.state_dict() for r in reducers]
    overflow = [g * 2.0 ** 20 for g in grads()]  # the scaled step: its leftovers are huge
    overflow[0][123] = bad
    outs = reduce_all(reducers, overflow)
    assert all(not np.isfinite(o).all() for o in outs)
    assert_same_residuals(copies(reducers), before)
    fresh = make(2, codec, ef=True, ops=ops)
    for f, s in zip(fresh, state):
        f.load_state_dict(s)
    finite = grads()
    got, want = reduce_all(reducers, finite), reduce_all(fresh, finite)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert_same_residuals(copies(reducers), copies(fresh))


@pytest.mark.parametrize("ops", [OPS, BlindOps()], ids=["eager", "traced"])
@pytest.mark.parametrize("name", ["int8", "topk"])
def test_a_first_step_with_nonfinite_result_leaves_zero_residuals(name, ops):
    codec = codecs.get(name)
    reducers = make(2, codec, ef=True, ops=ops)
    grads = [np.full(600, 3.0e5, np.float32), np.full(600, 1.0e5, np.float32)]
    grads[1][5] = -np.inf
    reduce_all(reducers, grads)
    for w, s in copies(reducers):
        assert w and s and all(not v.any() for v in list(w.values()) + list(s.values()))
    finite = [np.linspace(-1, 1, 600, dtype=np.float32), np.ones(600, np.float32)]
    np.testing.assert_array_equal(reduce_all(reducers, finite)[0],
                                  reduce_all(make(2, codec, ef=True, ops=ops), finite)[0])


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_a_finite_step_keeps_its_residuals_where_the_guard_cannot_tell(name):
    """The select keeps a finite step's residuals (the traced case: the guard always says False)."""
    rng = np.random.default_rng(8)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(2)]
    blind, eager = make(2, codecs.get(name), ef=True, ops=BlindOps()), make(2, codecs.get(name), ef=True)
    for _ in range(2):
        np.testing.assert_array_equal(reduce_all(blind, grads)[0], reduce_all(eager, grads)[0])
    assert_same_residuals(copies(blind), copies(eager))
    assert all(np.abs(w["b0"]).max() > 0 for w, _ in copies(blind))
