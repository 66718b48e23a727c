"""powersgd's low-rank reducer on P simulated workers (numpy ops, in-process collectives) against a
direct float64 numpy replay of the algorithm; error feedback, warm start, state, and where the
settings refuse it."""
import numpy as np
import pytest

from hvdp import codecs
from hvdp.codecs.auto import Auto
from hvdp.reduce.collectives import AVERAGE, SUM
from hvdp.reduce.engine import Engine
from hvdp.reduce.lowrank import LowRankReducer, seeded_init
from hvdp.ops import NumpyOps
from hvdp.reduce.plan import CompressionPolicy
from hvdp.reduce.settings import ReduceSettings, is_low_rank, is_two_phase
from hvdp.reduce.simcomm import FakeGroup

OPS = NumpyOps()
# compressed at rank 2: (32, 24) and (8, 4, 5) seen as 8 x 20; uncompressed: the vector and the
# 4 x 4 matrix ((4 + 4) * 2 * 2 > 16: the factors would not save the default rate of 2)
SHAPES = [(32, 24), (16,), (8, 4, 5), (4, 4)]
N = sum(int(np.prod(s)) for s in SHAPES)
# the float32 reducer against the float64 replay, relative to the largest |value| of the result
RTOL = 2e-5


def orth64(a):
    return np.linalg.qr(a.astype(np.float64))[0]


def reference(codec, steps_grads, q0, p, error_feedback=True):
    """PowerSGD written out directly: steps_grads[t][rank] is that rank's flat bucket. -> the
    averaged bucket per step, and every rank's residual at the end."""
    parts, off = [], 0
    for s in SHAPES:
        k = int(np.prod(s))
        parts.append((off, k, codec.matrix(s)))
        off += k
    qs = [q.astype(np.float64) for q in q0]
    res = [np.zeros(N) for _ in range(p)]
    outs = []
    for grads in steps_grads:
        xs = [g.astype(np.float64) + (res[r] if error_feedback else 0) for r, g in enumerate(grads)]
        out = np.zeros(N)
        approx = np.zeros(N)
        j, new_qs = 0, []
        for o, k, mat in parts:
            if mat is None:
                out[o:o + k] = sum(x[o:o + k] for x in xs) / p
                approx[o:o + k] = out[o:o + k]
                continue
            n, m, _ = mat
            ms = [x[o:o + k].reshape(n, m) for x in xs]
            q = orth64(qs[j])
            big_p = orth64(sum(mi @ q for mi in ms))
            q_avg = sum(mi.T @ big_p for mi in ms) / p
            out[o:o + k] = (big_p @ q_avg.T).ravel()
            approx[o:o + k] = out[o:o + k]
            new_qs.append(q_avg)
            j += 1
        qs = new_qs if codec.warm_start else qs
        # hvdp keeps no residual for the uncompressed tensors (DDP's hook keeps x - average
        # there, whose mean over the ranks is zero)
        plain = np.zeros(N, bool)
        for o, k, mat in parts:
            plain[o:o + k] = mat is None
        res = [np.where(plain, 0.0, x - approx) for x in xs]
        outs.append(out)
    return outs, res


def reducers(p, codec, init_q=None, op=AVERAGE, ef=True, postscale=1.0):
    group = FakeGroup(p)
    rs = [LowRankReducer(codec, OPS, c, ef, op, postscale, init_q=init_q) for c in group.comms]
    for r in rs:
        r.set_shapes({"b0": SHAPES})
    return rs


def run(rs, flats):
    pend = [r.start("b0", f) for r, f in zip(rs, flats)]
    for r, pd in zip(rs, pend):
        r.exchange(pd)
    return [r.finish(pd) for r, pd in zip(rs, pend)]


def fixed_init(q0):
    return lambda name, dims: [q.copy() for q in q0]


def data(p, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(N) * (r + 1)).astype(np.float32) for r in range(p)] for _ in range(steps)]


def q_start(codec, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((codec.matrix(s)[1], codec.matrix(s)[2])).astype(np.float32)
            for s in SHAPES if codec.matrix(s)]


@pytest.mark.parametrize("p,rank", [(1, 2), (3, 2), (2, 4)])
def test_matches_reference(p, rank):
    codec = codecs.get("powersgd", rank=rank)
    q0, steps = q_start(codec), data(p, 4)
    rs = reducers(p, codec, fixed_init(q0))
    want, want_res = reference(codec, steps, q0, p)
    for t, flats in enumerate(steps):
        got = run(rs, flats)
        assert all(np.array_equal(got[0], g) for g in got[1:])  # every rank the same bits
        scale = float(np.abs(want[t]).max())
        assert float(np.abs(got[0] - want[t]).max()) <= RTOL * scale, t
    for r, wr in zip(rs, want_res):
        assert float(np.abs(r.worker.get("b0") - wr).max()) <= RTOL * float(np.abs(wr).max()) * 10


def test_uncompressed_tensors_exact_and_no_residual():
    codec = codecs.get("powersgd", rank=2)
    steps = data(2, 1)
    out = run(reducers(2, codec), steps[0])[0]
    exact = (steps[0][0] + steps[0][1]) / 2
    o = 32 * 24
    np.testing.assert_array_equal(out[o:o + 16], exact[o:o + 16])     # the vector
    np.testing.assert_array_equal(out[-16:], exact[-16:])             # the 4 x 4 matrix
    rs = reducers(2, codec)
    run(rs, steps[0])
    assert not rs[0].worker.get("b0")[o:o + 16].any()


def test_error_feedback_telescopes():
    """With error feedback nothing is lost: the outputs so far plus the mean residual are the
    sum of the mean gradients (exact arithmetic; float32 here)."""
    p, codec = 3, codecs.get("powersgd", rank=1)
    steps = data(p, 6, seed=1)
    rs = reducers(p, codec)
    total_out = np.zeros(N)
    for flats in steps:
        total_out += run(rs, flats)[0]
    total_in = sum(np.mean(fl, axis=0).astype(np.float64) for fl in steps)
    mean_res = np.mean([r.worker.get("b0") for r in rs], axis=0)
    assert np.allclose(total_out + mean_res, total_in, atol=1e-4 * float(np.abs(total_in).max()))
    # and the residual is what the next step adds: without error feedback the outputs differ
    off = reducers(p, codec, ef=False)
    for flats in steps[:2]:
        plain = run(off, flats)[0]
    assert off[0].worker.get("b0") is None and not np.allclose(plain, run(reducers(p, codec), steps[1])[0])


def test_warm_start_converges_to_best_rank_r():
    """The same gradient every step, no error feedback: warm start is a power iteration, so the
    approximation tends to the truncated SVD; without warm start it does not improve."""
    rng = np.random.default_rng(5)
    u, v = rng.standard_normal((32, 3)), rng.standard_normal((3, 24))
    m = (u * [10.0, 3.0, 1.0]) @ v + 0.01 * rng.standard_normal((32, 24))
    flat = np.concatenate([m.ravel(), np.zeros(N - 32 * 24)]).astype(np.float32)
    uu, s, vt = np.linalg.svd(m)
    best = (uu[:, :2] * s[:2]) @ vt[:2]
    for warm, bound in ((True, 1e-3), (False, None)):
        codec = codecs.get("powersgd", rank=2, warm_start=warm)
        rs = reducers(2, codec, ef=False)
        for _ in range(12):
            out = run(rs, [flat, flat])[0]
        err = np.abs(out[:32 * 24].reshape(32, 24) - best).max() / np.abs(best).max()
        if bound is not None:
            assert err < bound and rs[0].server.get("b0").size == 24 * 2 + 20 * 2
        else:
            assert rs[0].server.get("b0") is None


def test_seeded_init_same_on_every_rank_and_new_per_draw():
    a, b = seeded_init(7), seeded_init(7)
    x, y = a("b0", [(5, 2)]), b("b0", [(5, 2)])
    np.testing.assert_array_equal(x[0], y[0])
    assert not np.array_equal(a("b0", [(5, 2)])[0], x[0])
    assert not np.array_equal(seeded_init(8)("b0", [(5, 2)])[0], x[0])


def test_state_round_trip_continues_identically():
    codec = codecs.get("powersgd", rank=2)
    steps = data(2, 4, seed=2)
    rs = reducers(2, codec)
    for flats in steps[:2]:
        run(rs, flats)
    saved = [r.state_dict() for r in rs]
    want = [run(rs, flats)[0] for flats in steps[2:]]
    fresh = reducers(2, codec)  # its own first draw is the same: only the loaded Qs make it continue
    for r, s in zip(fresh, saved):
        r.load_state_dict(s)
    got = [run(fresh, flats)[0] for flats in steps[2:]]
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)
    other = reducers(2, codecs.get("powersgd", rank=1))
    other[0].load_state_dict(saved[0])  # another codec's state is not taken
    assert other[0].worker.get("b0") is None and other[0].server.get("b0") is None


def test_zero_gradient_neither_nan_nor_stuck():
    """A matrix whose gradient is zero for a step (Presence reduces a missing gradient as zeros)
    gives zeros, and later steps still compress it (its Q column is not left at zero)."""
    codec = codecs.get("powersgd", rank=1)
    rs = reducers(2, codec)
    zero = np.zeros(N, np.float32)
    out = run(rs, [zero, zero])[0]
    assert np.isfinite(out).all() and not out.any()
    flats = data(2, 1)[0]
    out = run(rs, flats)[0]
    assert np.isfinite(out).all() and np.abs(out[:32 * 24]).max() > 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nonfinite_step_keeps_state():
    codec = codecs.get("powersgd", rank=2)
    steps = data(2, 2)
    rs = reducers(2, codec)
    run(rs, steps[0])
    before = (rs[0].worker.get("b0"), rs[0].server.get("b0"))
    bad = steps[1][0].copy()
    bad[3] = np.inf
    out = run(rs, [bad, steps[1][1]])
    assert not np.isfinite(out[0]).all()
    np.testing.assert_array_equal(rs[0].worker.get("b0"), before[0])  # a select: the values as they were
    np.testing.assert_array_equal(rs[0].server.get("b0"), before[1])
    fresh = reducers(2, codec)  # a non-finite first step: zeros ("none yet"), the same next step as none
    run(fresh, [bad, steps[1][1]])
    assert not fresh[0].worker.get("b0").any() and not fresh[0].server.get("b0").any()
    np.testing.assert_array_equal(run(fresh, steps[0])[0], run(reducers(2, codec), steps[0])[0])


def test_sum_and_postscale():
    codec = codecs.get("powersgd", rank=2)
    q0, steps = q_start(codec), data(2, 1)
    avg = run(reducers(2, codec, fixed_init(q0)), steps[0])[0]
    summed = run(reducers(2, codec, fixed_init(q0), op=SUM), steps[0])[0]
    np.testing.assert_allclose(summed, 2 * avg, rtol=1e-5, atol=1e-5 * float(np.abs(avg).max()))
    scaled = run(reducers(2, codec, fixed_init(q0), postscale=4.0), [f / 4.0 for f in steps[0]])[0]
    np.testing.assert_allclose(scaled, avg, rtol=1e-5, atol=1e-5 * float(np.abs(avg).max()))


def test_codec_settings_and_refusals():
    c = codecs.get("powersgd", rank=4)
    assert str(c) == "powersgd(rank=4, min_compression_rate=2.0, warm_start=True, seed=0)"
    assert codecs.Compression.powersgd.rank == 1 and is_low_rank(c) and not is_two_phase(c)
    assert c.matrix((10,)) is None and c.matrix((64, 3, 3, 3)) == (64, 27, 4) and c.matrix((8, 8)) is None
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="rank"):
            codecs.get("powersgd", rank=bad)
    s = ReduceSettings(c, CompressionPolicy())
    assert s.low_rank and s.bucketed and not s.two_phase
    with pytest.raises(ValueError, match="hierarchical=True is not supported with powersgd"):
        ReduceSettings(c, CompressionPolicy(), hierarchical=True)
    with pytest.raises(ValueError, match="uneven_inputs=True"):
        ReduceSettings(c, CompressionPolicy(), uneven_inputs=True)
    with pytest.raises(ValueError, match="auto cannot choose powersgd.*compression='powersgd'"):
        Auto(candidates=("none", "powersgd"))
    assert "powersgd" not in [x.name for x in Auto().candidates]
    with pytest.raises(ValueError, match="low-rank factors of whole matrices"):
        c.compress(np.zeros(3, np.float32))  # no Horovod compressor: hvd.allreduce(compression=) refuses it


def test_start_powerSGD_iter_is_a_warm_up_of_plain_steps():
    """DDP's ``start_powerSGD_iter``: that many plain steps first, through the policy's warm-up
    (the larger of the two counts); named in the codec's string only where set."""
    c = codecs.get("powersgd", rank=4, start_powerSGD_iter=10)
    assert c.warmup_steps == 10 and codecs.get("powersgd").warmup_steps == 0 and codecs.get("int8").warmup_steps == 0
    assert str(c) == "powersgd(rank=4, min_compression_rate=2.0, warm_start=True, seed=0, start_powerSGD_iter=10)"
    assert ReduceSettings(c, CompressionPolicy()).policy.warmup_steps == 10
    assert ReduceSettings(c, CompressionPolicy(warmup_steps=20)).policy.warmup_steps == 20
    assert ReduceSettings(codecs.get("powersgd"), CompressionPolicy(warmup_steps=3)).policy.warmup_steps == 3
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="start_powerSGD_iter must be an int >= 0"):
            codecs.get("powersgd", start_powerSGD_iter=bad)
    group = FakeGroup(2)
    engs = [Engine(ReduceSettings(c, CompressionPolicy(min_elements=1)), OPS, cm, _Plain(cm), lambda d, n: [d, d])
            for cm in group.comms]
    assert all(not e.compressing for e in engs)  # step 0 of 10: plain allreduce


class _Plain:
    def __init__(self, comm):
        self.comm = comm

    def is_sparse(self, g):
        return False

    def dense(self, g):
        return g

    def submit(self, grads, name, wire):
        return [((self.comm.allreduce_async(g, f"{name}.{i}", AVERAGE), g.dtype), g.nbytes)
                for i, g in enumerate(grads)]

    def finish(self, pending):
        return self.comm.wait(pending[0]).astype(pending[1])


def test_engine_drives_it_with_stats_and_state():
    names = ["w1", "b1", "w2", "w3"]
    codec = codecs.get("powersgd", rank=2)
    group = FakeGroup(2)
    settings = ReduceSettings(codec, CompressionPolicy(min_elements=20))
    engs = [Engine(settings, OPS, c, _Plain(c), lambda d, n: [d, d]) for c in group.comms]
    for e in engs:
        e.set_layout(names, SHAPES, [True] * 4)
        assert isinstance(e.reducer, LowRankReducer) and e.plan.plain == (1, 3)  # under 20 elements
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(2)]
    # drive phase by phase (the fake comm needs every rank's part before a wait)
    pend = []
    for e, g in zip(engs, grads):
        pend.append({i: e.start_plain([g[i]], names[i])[0] for i in e.plan.plain})
        for b, idx in enumerate(e.plan.buckets):
            e.start_bucket(b, [g[i] for i in idx])
    for e in engs:
        e.exchange_all()
    outs = []
    for e, pl in zip(engs, pend):
        out = {i: e.plain.finish(pd) for i, pd in pl.items()}
        for b, flat in e.finish_buckets():
            for i, piece in e.pieces(b, flat):
                out[i] = piece
        e.end_step()
        outs.append(out)
    np.testing.assert_allclose(outs[0][1], (grads[0][1] + grads[1][1]) / 2, rtol=1e-6)
    st = engs[0].summary()["last_step"]
    lay_p, lay_q = 32 * 2 + 8 * 2, 24 * 2 + 20 * 2
    assert st["powersgd"]["handed"] == 4 * (lay_p + lay_q)
    assert st["powersgd"]["elements"] == 32 * 24 + 8 * 20
    assert 0 < st["powersgd"]["ratio"] < 0.25 and st["none"]["elements"] == 32
    saved = engs[0].state()["reducer"]
    assert set(saved["worker"]) == {"b0"} and set(saved["server"]) == {"b0"}


class ZeroStore:
    """A store that makes its entries as zeros ahead (as hvdp.keras's torch-backend store does)."""

    def __init__(self):
        self.data = {}

    def create(self, name, n):
        if name not in self.data or self.data[name].size != n:
            self.data[name] = np.zeros(n, np.float32)

    def get(self, name):
        return self.data.get(name)

    def set(self, name, value):
        self.data[name] = value

    def snapshot(self):
        return dict(self.data)

    def restore(self, data):
        self.data = {k: data.get(k, np.zeros_like(v)) for k, v in self.data.items()}


def test_store_made_as_zeros_gives_the_same_steps():
    """Zeros made ahead by a store (engine.relayout, sized by store_sizes) mean "no Q yet": the
    same bits as an in-memory store that starts empty."""
    codec, names = codecs.get("powersgd", rank=2), ["a", "b", "c", "d"]
    rng = np.random.default_rng(4)
    steps = [[[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(2)] for _ in range(3)]
    outs = {}
    for kind in ("dict", "zeros"):
        group = FakeGroup(2)
        settings = ReduceSettings(codec, CompressionPolicy(min_elements=1))
        engs = [Engine(settings, OPS, c, _Plain(c), lambda d, n: [d, d],
                       make_store=(lambda side: ZeroStore()) if kind == "zeros" else None) for c in group.comms]
        for e in engs:
            e.set_layout(names, SHAPES, [True] * 4)
        if kind == "zeros":
            assert engs[0].reducer.server.get("b0").size == 24 * 2 + 20 * 2  # made by relayout
        outs[kind] = []
        for grads in steps:
            for e, g in zip(engs, grads):
                e.start_bucket(0, [g[i] for i in e.plan.buckets[0]])
            for e in engs:
                e.exchange_all()
            outs[kind].append([flat for e in engs for _, flat in e.finish_buckets()][0])
    for a, b in zip(outs["dict"], outs["zeros"]):
        np.testing.assert_array_equal(a, b)


def test_join_refusal_names_the_fix():
    from hvdp.reduce.join import refusal
    msg = refusal("powersgd", "torch")
    assert "does not support uneven inputs" in msg and "same number of steps" in msg
    assert "alltoall" in refusal("int8", "torch") and "alltoall" in refusal("auto", "keras")


def test_vectors_only_bucket_and_a_new_layout():
    """A bucket with nothing to compress is one plain allreduce (zero residual); a new layout
    under the same bucket name starts from a fresh draw of the right shapes."""
    codec = codecs.get("powersgd", rank=2)
    group = FakeGroup(2)
    rs = [LowRankReducer(codec, OPS, c, True) for c in group.comms]
    rng = np.random.default_rng(6)
    for shapes in ([(50,), (4, 4)], [(32, 24), (10,)], [(24, 32), (10,)]):  # then other (m, r) under "b0"
        n = sum(int(np.prod(s)) for s in shapes)
        for r in rs:
            r.set_shapes({"b0": shapes})
            r.worker.restore({})
            r.server.restore({})
        flats = [rng.standard_normal(n).astype(np.float32) for _ in rs]
        for _ in range(2):
            pend = [r.start("b0", f) for r, f in zip(rs, flats)]
            for r, pd in zip(rs, pend):
                r.exchange(pd)
            out = [r.finish(pd) for r, pd in zip(rs, pend)]
        assert np.isfinite(out[0]).all() and np.array_equal(out[0], out[1])
        if shapes[0] == (50,):
            np.testing.assert_array_equal(out[0], (flats[0] + flats[1]) / 2)
            assert not rs[0].worker.get("b0").any() and rs[0].server.get("b0") is None
