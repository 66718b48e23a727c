"""hvdp.reduce.join on simulated workers: the joined-step path, its residual rule, the decision."""
import gc

import numpy as np
import pytest

from hvdp import codecs
from hvdp.reduce.collectives import AVERAGE, SUM
from hvdp.reduce.join import (JoinableReducer, Registry, joined_average, refusal, someone_joined)
from hvdp.ops import NumpyOps
from hvdp.reduce.simcomm import FakeGroup
from hvdp.reduce.twophase import TwoPhaseReducer

OPS = NumpyOps()
TWO_PHASE = ["bf16", "int8", "topk"]


def reducers(p, codec, ef, op=AVERAGE, flags=None):
    group = FakeGroup(p)
    flags = flags if flags is not None else {"joined": False}
    return [JoinableReducer(TwoPhaseReducer(codecs.get(codec), OPS, c, ef, op), lambda: flags["joined"])
            for c in group.comms], flags


def step(reds, grads, active, name="b0"):
    """One step: active ranks reduce; a joined rank answers the allreduce with zeros (as
    Horovod's join does). Returns the active ranks' outputs."""
    pend = {}
    for r, (red, g) in enumerate(zip(reds, grads)):
        if active[r]:
            pend[r] = red.start(name, g)
        else:  # Horovod's join: zeros of the same size
            _, padded = red.layout(g.size)
            inner = red.inner  # the two-phase reducer the join control wraps
            inner.comm.allreduce_async(np.zeros(padded, np.float32), f"hvdp.join.{name}", inner.op, 1.0,
                                       inner.postscale)
    for r, p in pend.items():
        reds[r].exchange(p)
    return {r: reds[r].finish(p) for r, p in pend.items()}


@pytest.mark.parametrize("codec", TWO_PHASE)
@pytest.mark.parametrize("op", [AVERAGE, SUM])
def test_joined_step_is_horovods_average_of_the_active_ranks(codec, op):
    rng = np.random.default_rng(0)
    p, n = 3, 1001
    reds, flags = reducers(p, codec, ef=False, op=op)
    flags["joined"] = True
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    active = [True, False, True]
    outs = step(reds, grads, active)
    want = joined_average(grads, active, op)
    for o in outs.values():
        np.testing.assert_array_equal(o, outs[0])
        np.testing.assert_allclose(o, want, rtol=1e-6, atol=1e-6)
    # the sum must leave out rank 1 (a test that cannot tell is no test)
    assert np.abs(outs[0] - joined_average(grads, [True] * p, op)).max() > 1e-3


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_residual_rule(codec):
    """Active ranks flush their worker residual into the float32 allreduce; the joined rank keeps
    its own; server residuals stay as they are on every rank."""
    rng = np.random.default_rng(1)
    p, n = 2, 4096
    reds, flags = reducers(p, codec, ef=True)
    g0 = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    step(reds, g0, [True, True])  # a normal step leaves residuals
    worker = [r.worker.get("b0").copy() for r in reds]
    server = [r.server.get("b0").copy() for r in reds]
    assert all(np.abs(w).max() > 0 for w in worker) and all(np.abs(s).max() > 0 for s in server)
    flags["joined"] = True
    g1 = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    out = step(reds, g1, [True, False])[0]
    np.testing.assert_allclose(out, (g1[0] + worker[0][:n]) / p, rtol=1e-6, atol=1e-7)
    assert not np.any(reds[0].worker.get("b0"))                    # flushed: sent whole
    np.testing.assert_array_equal(reds[1].worker.get("b0"), worker[1])  # joined: kept
    for r in range(p):
        np.testing.assert_array_equal(reds[r].server.get("b0"), server[r])


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_a_joined_step_with_nonfinite_result_keeps_the_worker_residual(codec):
    """A loss scaler skips a joined step whose result is not finite: the active rank's worker
    residual is not flushed by it (every residual as before the step)."""
    rng = np.random.default_rng(2)
    p, n = 3, 2048
    reds, flags = reducers(p, codec, ef=True)
    step(reds, [rng.standard_normal(n).astype(np.float32) for _ in range(p)], [True] * p)
    worker = [r.worker.get("b0").copy() for r in reds]
    server = [r.server.get("b0").copy() for r in reds]
    flags["joined"] = True
    g = [rng.standard_normal(n).astype(np.float32) * 2.0 ** 20 for _ in range(p)]
    g[2][7] = np.inf
    outs = step(reds, g, [True, False, True])
    assert all(not np.isfinite(o).all() for o in outs.values())
    for r in range(p):
        np.testing.assert_array_equal(reds[r].worker.get("b0"), worker[r])
        np.testing.assert_array_equal(reds[r].server.get("b0"), server[r])


def test_error_feedback_telescopes_across_a_joined_tail():
    """4 steps all active, 1 step with rank 1 joined: the applied updates add up to the exact
    contributions, up to what the joined rank and the servers still hold."""
    rng = np.random.default_rng(2)
    p, n, steps = 2, 3000, 5
    reds, flags = reducers(p, "int8", ef=True)
    applied, exact = np.zeros(n), np.zeros(n)
    for t in range(steps):
        active = [True, t < steps - 1]
        flags["joined"] = not all(active)
        grads = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
        applied += step(reds, grads, active)[0]
        exact += joined_average(grads, active)
    owed = reds[1].worker.get("b0")[:n] / p + np.concatenate([r.server.get("b0") for r in reds])[:n]
    np.testing.assert_allclose(applied + owed, exact, atol=1e-5)


def test_no_one_joined_is_the_two_phase_path():
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(500).astype(np.float32) for _ in range(2)]
    reds, _ = reducers(2, "int8", ef=False)
    plain = [TwoPhaseReducer(codecs.get("int8"), OPS, c, False) for c in FakeGroup(2).comms]
    got = step(reds, grads, [True, True])[0]
    want = step(plain, grads, [True, True])[0]
    np.testing.assert_array_equal(got, want)


def test_someone_joined():
    assert someone_joined(3.0, 3) is False
    assert someone_joined(1.0, 3) is True
    with pytest.raises(RuntimeError, match="uneven_inputs"):
        someone_joined(0.0, 2)
    with pytest.raises(RuntimeError, match="uneven_inputs"):
        someone_joined(3.0, 2)


def test_refusal_names_the_fix():
    msg = refusal("int8", "torch")  # uneven_inputs=False was passed
    assert "uneven_inputs=False" in msg and "int8" in msg and "JoinCallback" not in msg
    assert "uneven_inputs=True" not in msg  # the default already turns it on
    assert "JoinCallback" in refusal("topk", "keras")
    msg = refusal("int8", "torch", "hierarchical")
    assert "hierarchical=True" in msg and "reduce-scatter" in msg and "uneven_inputs=True" not in msg
    assert "int8" in refusal("powersgd", "torch", "low_rank") and "uneven_inputs" not in refusal(
        "powersgd", "torch", "low_rank")
    assert "DistributedGradientTape" in refusal("int8", "keras", "tape")
    with pytest.raises(ValueError):
        refusal("int8", "torch", "because")


@pytest.mark.parametrize("codec,kw,resolved,off", [
    ("int8", {}, True, None), ("bf16", {}, True, None), ("topk", {}, True, None), ("int4", {}, True, None),
    ("none", {}, True, None), ("int8", dict(uneven_inputs=False), False, "off"),
    ("int8", dict(uneven_inputs=True), True, None),
    ("int8", dict(hierarchical=True), False, "hierarchical"),
    ("powersgd", {}, False, "low_rank"),
])
def test_uneven_inputs_default_is_on_where_supported(codec, kw, resolved, off):
    from hvdp.reduce.plan import CompressionPolicy
    from hvdp.reduce.settings import ReduceSettings
    s = ReduceSettings(codecs.get(codec), CompressionPolicy(), **kw)
    assert s.uneven_inputs is resolved and s.join_off == off
    assert s.uneven_requested == kw.get("uneven_inputs")
    if off in ("hierarchical", "low_rank"):  # insisting where it is unsupported is still an error
        with pytest.raises(ValueError, match="uneven_inputs=True"):
            ReduceSettings(codecs.get(codec), CompressionPolicy(), **dict(kw, uneven_inputs=True))


def test_registry_is_weak_and_ordered():
    class Obj:
        pass
    reg, a, b = Registry(), Obj(), Obj()
    reg.add(a)
    reg.add(b)
    assert reg.alive() == [a, b]
    del a
    gc.collect()
    assert reg.alive() == [b]


def test_registry_keeps_only_what_every_rank_still_holds():
    # rank 1 still holds its first optimizer (a framework cache kept it); rank 0 dropped it: the
    # join must not broadcast it on rank 1 only (a mismatched collective)
    class Obj:
        pass
    regs = [Registry(), Registry()]
    held = [[Obj(), Obj(), Obj()], [Obj(), Obj(), Obj()]]
    for reg, objs in zip(regs, held):
        for o in objs:
            reg.add(o)
    held[0][0] = None
    gc.collect()
    lists = [[n for n, _ in reg._numbered()] for reg in regs]
    assert lists == [[1, 2], [0, 1, 2]]
    seen = []

    def allgather(obj, name):
        seen.append(name)
        return lists

    assert regs[0].alive_on_every_rank(allgather, "x") == held[0][1:]
    assert regs[1].alive_on_every_rank(allgather, "x") == held[1][1:]
    assert seen == ["x", "x"]
