"""Outer steps (hvdp.outer) on P simulated workers, each in its own thread with its own engine,
against a float64 numpy model of the algorithm fed the same per-rank data: H > 1, Nesterov,
fragments with a delay and mixing; H = 1 with outer lr 1 and no momentum is plain data
parallelism; every codec keeps the ranks bit-identical after each sync; a checkpoint taken
mid-interval resumes to the uninterrupted run's bits."""

import time

import numpy as np
import pytest

from hvdp import codecs
from hvdp.ops import NumpyOps
from hvdp.outer import OuterLoop, OuterSettings
from hvdp.reduce.engine import Engine
from hvdp.reduce.plan import CompressionPolicy
from hvdp.reduce.settings import ReduceSettings
from hvdp.reduce.simcomm import FakeGroup
from test_engine import NumpyPlain, gather
from test_hierarchy import run_threads

OPS = NumpyOps()
P = 2
SHAPES = [(12, 6), (6,), (6, 3), (3,)]
INNER_LR = 0.05


def data(p=P, n=16, seed=0):
    """Each rank's inputs and targets of a two-layer linear regression (its own slice)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n, 12)), rng.standard_normal((n, 3))) for _ in range(p)]


def init(seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in SHAPES]


def grads(params, x, y):
    """Gradients of 0.5 * mean ||relu-free two-layer(x) - y||^2, in the params' dtype."""
    w1, b1, w2, b2 = (np.asarray(p, np.float64) for p in params)
    h = x @ w1 + b1
    out = h @ w2 + b2
    d = (out - y) / len(x)
    gw2, gb2 = h.T @ d, d.sum(0)
    dh = d @ w2.T
    gw1, gb1 = x.T @ dh, dh.sum(0)
    return [g.astype(params[0].dtype) for g in (gw1, gb1, gw2, gb2)]


def reference(settings, steps, start, ranks):
    """The algorithm in float64: inner SGD per rank, exact averages, outer SGD (torch's rule)."""
    H, K = settings.sync_every, settings.fragments
    frags = [list(range(len(SHAPES)))] if K == 1 else [[0, 1], [2, 3]]
    local = [[p.astype(np.float64) for p in start] for _ in ranks]
    glob = [p.astype(np.float64) for p in start]
    mom = [None] * len(SHAPES)
    flight = {}  # fragment -> (lands at, averaged pseudo-gradient)
    for _ in range(settings.warmup):  # synchronous: every rank steps on the averaged gradient
        g = [np.mean(gs, axis=0) for gs in zip(*(grads(local[0], x, y) for x, y in ranks))]
        local = [[p - INNER_LR * gi for p, gi in zip(local[0], g)] for _ in ranks]
    glob = [p.copy() for p in local[0]]
    for s in range(1, steps - settings.warmup + 1):
        for r, (x, y) in enumerate(ranks):
            local[r] = [p - INNER_LR * g for p, g in zip(local[r], grads(local[r], x, y))]
        due = [f for f, (at, _) in flight.items() if at == s]
        starts = [f for f in range(K) if s % H == settings.offset(f)]
        for f in starts:
            avg = [np.mean([glob[i] - local[r][i] for r in range(len(ranks))], axis=0) for i in frags[f]]
            flight[f] = (s + settings.delay, avg)
        for f in sorted(set(due) | {f for f in starts if settings.delay == 0}):
            _, avg = flight.pop(f)
            for i, g in zip(frags[f], avg):
                d = g
                if settings.momentum:
                    mom[i] = g.copy() if mom[i] is None else settings.momentum * mom[i] + g
                    d = g + settings.momentum * mom[i] if settings.nesterov else mom[i]
                glob[i] = glob[i] - settings.lr * d
                for r in range(len(ranks)):
                    local[r][i] = settings.mix * local[r][i] + (1 - settings.mix) * glob[i]
    return local


def make_engine(codec, comm, idx, describe):
    rs = ReduceSettings(codecs.get(codec), CompressionPolicy(min_elements=1), extra=(("outer", describe),))
    e = Engine(rs, OPS, comm, NumpyPlain(comm, "average"), gather(comm))
    e.set_layout([f"t{i}" for i in idx], [SHAPES[i] for i in idx], [True] * len(idx))
    return e


def make_loop(settings, comm, codec, start, frags, clock=None):
    engs = [make_engine(codec, comm, f, settings.describe()) for f in frags]
    warm = None  # warmup_compression: the adapter's warm-up engine over every tensor
    if settings.warmup_compression != "none":
        warm = make_engine(settings.warmup_compression, comm, range(len(SHAPES)), settings.describe())
    return OuterLoop(settings, OPS, engs, frags, start, warmup_engine=warm, **({"clock": clock} if clock else {}))


def phases(loop):
    """The phase of every bucket of every fragment in flight."""
    return [pend.phase for f in loop._inflight for pend in loop.engines[f]._pending.values()]


def run(settings, steps, codec="none", seed=0, stop_at=None, resume=None, clock=None, progress=False):
    """Every rank trains ``steps`` inner steps (float32) with outer steps; -> each rank's final
    parameters and, per rank, the parameters right after every sync. ``stop_at``: also return
    every rank's loop state at that step; ``resume``: (step, states) to start from. ``progress``:
    before each inner step's update, ``loop.progress()`` (hvdp.torch's gradient hooks) until
    every bucket in flight is past its first phase; ``run.ahead`` counts those steps per rank."""
    ranks, start = data(seed=seed), init()
    frags = [list(range(len(SHAPES)))] if settings.fragments == 1 else [[0, 1], [2, 3]]
    group = FakeGroup(P, blocking=True)
    finals, synced, saved, errors = [None] * P, [[] for _ in range(P)], [None] * P, []
    loops = run.loops = [None] * P
    ahead = run.ahead = [0] * P

    def worker(r):
        try:
            params = [p.copy() for p in start]
            loop = make_loop(settings, group.comms[r], codec, start, frags, clock and clock())
            loops[r] = loop
            first = 1
            if resume is not None:
                first = resume[0] + 1
                params = [p.copy() for p in resume[1][r]["params"]]
                loop.load_state(resume[1][r]["loop"])
            for s in range(first, steps + 1):
                x, y = ranks[r]
                if loop.warming_up and loop.warmup_engine is not None:  # this rank's gradients through it
                    g = loop.warmup_engine.reduce(grads(params, x, y))
                elif loop.warming_up:  # the adapter's gradient average (float32, every rank's data)
                    g = [np.mean(gs, axis=0, dtype=np.float32) for gs in zip(*(grads(params, *d) for d in ranks))]
                else:
                    g = grads(params, x, y)
                if progress and loop.in_flight:  # the other rank's first phase may still be coming
                    deadline = time.monotonic() + 10
                    while min(phases(loop), default=2) < 2 and time.monotonic() < deadline:
                        loop.progress()
                        time.sleep(0.001)
                    ahead[r] += min(phases(loop), default=1) >= 2
                params = [p - np.float32(INNER_LR) * gi for p, gi in zip(params, g)]
                landed = loop.after_step(params)
                for i, v in landed:
                    params[i] = v
                if landed:  # what just landed (a fragment's tensors): the same on every rank
                    synced[r].append((s, [params[i].copy() for i, _ in landed]))
                if s == stop_at:
                    saved[r] = {"params": [p.copy() for p in params], "loop": loop.state()}
            finals[r] = params
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    run_threads(worker, P, errors)
    return finals, synced, saved


def assert_ranks_identical_after_syncs(synced):
    assert synced[0], "no sync happened"
    for (s0, p0), (s1, p1) in zip(synced[0], synced[1]):
        assert s0 == s1
        for a, b in zip(p0, p1):
            assert np.array_equal(a, b), f"ranks differ after the sync at step {s0}"


CASES = {
    "diloco_h4": OuterSettings(sync_every=4),
    "sgd_h3_no_nesterov": OuterSettings(sync_every=3, lr=0.5, momentum=0.5, nesterov=False),
    "averaging_h5": OuterSettings(sync_every=5, lr=1.0, momentum=0.0, nesterov=False),
    "streaming_k2_tau1": OuterSettings(sync_every=4, fragments=2, delay=1),
    "streaming_k2_tau2_mix": OuterSettings(sync_every=6, fragments=2, delay=2, mix=0.5),
    "diloco_h4_warmup5": OuterSettings(sync_every=4, warmup=5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_outer_steps_match_the_float64_reference(case):
    settings = CASES[case]
    finals, synced, _ = run(settings, 24)
    want = reference(settings, 24, init(), data())
    for r in range(P):
        for got, ref in zip(finals[r], want[r]):
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
    if settings.mix == 0:
        assert_ranks_identical_after_syncs(synced)


def test_h1_outer_lr1_without_momentum_is_data_parallelism():
    """Each step: the average of the ranks' inner updates = one step on the averaged gradient."""
    settings = OuterSettings(sync_every=1, lr=1.0, momentum=0.0, nesterov=False)
    finals, synced, _ = run(settings, 20)
    ranks, params = data(), init()
    for _ in range(20):  # hvdp none's data parallelism, float32: the averaged gradient
        g = [np.mean([grads(params, x, y)[i] for x, y in ranks], axis=0, dtype=np.float32) for i in range(4)]
        params = [p - np.float32(INNER_LR) * gi for p, gi in zip(params, g)]
    assert len(synced[0]) == 20
    for got, want in zip(finals[0], params):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
def test_compressed_pseudo_gradients_keep_ranks_identical_and_near_the_reference(codec):
    settings = OuterSettings(sync_every=4)
    finals, synced, _ = run(settings, 24, codec=codec)
    assert_ranks_identical_after_syncs(synced)
    want = reference(settings, 24, init(), data())
    exact, _, _ = run(settings, 24)
    err = max(np.abs(g - w).max() for g, w in zip(finals[0], want[0]))
    err_none = max(np.abs(g - w).max() for g, w in zip(exact[0], want[0]))
    scale = max(np.abs(w).max() for w in want[0])
    # relative to the largest parameter (seen: 6e-4, 9e-4, 1.6e-2)
    bound = {"bf16": 3e-3, "int8": 4e-3, "int4": 5e-2}[codec]
    assert err <= bound * scale, (codec, err, scale)
    assert err > err_none, "the codec made no difference: was it applied?"


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("case", ["streaming_k2_tau1", "streaming_k2_tau2_mix"])
def test_progress_runs_a_fragment_ahead_with_the_same_bits(case, codec):
    """A streaming fragment's second phase started by ``OuterLoop.progress`` (during the inner
    steps before it lands) gives the same bits as the phase started at landing."""
    settings = CASES[case]
    late, late_synced, _ = run(settings, 24, codec=codec)
    assert run.ahead == [0, 0]
    early, early_synced, _ = run(settings, 24, codec=codec, progress=True)
    syncs = len(early_synced[0])
    assert syncs >= 6 and run.ahead[0] >= syncs - 1 and run.ahead[1] >= syncs - 1, (syncs, run.ahead)
    for r in range(P):
        for a, b in zip(late[r], early[r]):
            assert np.array_equal(a, b), f"{case} {codec}: rank {r} differs with progress"
    if settings.mix == 0:
        assert_ranks_identical_after_syncs(early_synced)


def test_drain_completes_the_fragments_in_flight():
    """The end of a streaming run: ``drain`` waits for the fragment in flight on every rank and
    leaves the global parameters as they were (its average is dropped)."""
    settings = CASES["streaming_k2_tau1"]
    run(settings, 10, codec="int8")  # H 4, offsets 0 and 2: fragment 1 starts at step 10, lands at 11
    loops = run.loops
    flying = [loop.in_flight for loop in loops]
    before = [[g.copy() for g in loop.globals] for loop in loops]
    errors = []
    run_threads(lambda r: loops[r].drain(), P, errors)
    assert not errors and not any(loop.in_flight for loop in loops)
    for loop, b in zip(loops, before):
        assert all(np.array_equal(g, h) for g, h in zip(loop.globals, b))
    assert flying == [True, True], flying


@pytest.mark.parametrize("stop_at", [3, 10])  # inside the warm-up, inside an interval
def test_checkpoint_mid_interval_resumes_to_the_same_bits(stop_at):
    settings = OuterSettings(sync_every=4, warmup=5)
    straight, _, saved = run(settings, 20, codec="int8", stop_at=stop_at)
    assert saved[0]["loop"]["warm"] == min(stop_at, 5)
    resumed, _, _ = run(settings, 20, codec="int8", resume=(stop_at, saved))
    for r in range(P):
        for a, b in zip(straight[r], resumed[r]):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("stop_at", [3, 10])  # inside the warm-up, inside an interval
def test_warmup_compression_carries_its_residuals_and_keeps_ranks_identical(stop_at):
    """warmup_compression="int8": the warm-up's gradients through their own engine (error
    feedback): every rank the same bits after it, near the float32 warm-up's run (int8's
    error), its residuals in the loop's state (after the fragments'), and a checkpoint inside
    or after the warm-up resumes to the uninterrupted run's bits; without them it does not."""
    settings = OuterSettings(sync_every=4, warmup=5, warmup_compression="int8")
    straight, synced, saved = run(settings, 20, codec="int8", stop_at=stop_at)
    assert_ranks_identical_after_syncs(synced)
    assert len(saved[0]["loop"]["engines"]) == 2 and saved[0]["loop"]["engines"][1]["reducer"]["worker"]
    fp32, _, _ = run(OuterSettings(sync_every=4, warmup=5), 20, codec="int8")
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(straight[0], fp32[0]))
    assert 0 < gap < 0.05, gap  # the int8 warm-up is not the float32 one, nor far from it
    resumed, _, _ = run(settings, 20, codec="int8", resume=(stop_at, saved))
    for r in range(P):
        for a, b in zip(straight[r], resumed[r]):
            assert np.array_equal(a, b)
    if stop_at <= settings.warmup:  # the warm-up's residuals lost: other bits
        for st in saved:
            st["loop"]["engines"] = st["loop"]["engines"][:1]
        lost, _, _ = run(settings, 20, codec="int8", resume=(stop_at, saved))
        assert any(not np.array_equal(a, b) for a, b in zip(straight[0], lost[0]))


def test_outer_codec_names_the_codecs_it_takes():
    from hvdp.outer import outer_codec
    assert outer_codec((codecs.get("int4"), None), "warmup_compression", "int4")[0].name == "int4"
    for resolved, value in (((None, object()), "hvd.Compression.fp16"), ((codecs.get("powersgd"), None), "powersgd")):
        with pytest.raises(ValueError, match="warm-up steps' gradients with hvdp's codecs.*'int8', 'int4' or 'topk'"):
            outer_codec(resolved, "warmup_compression", value)
    assert OuterSettings(sync_every=4, warmup=5).describe().endswith(" W=5")  # as saved before the option
    assert OuterSettings(sync_every=4, warmup=5, warmup_compression="int8").describe().endswith(" W=5/int8")


def test_warmup_steps_not_given_is_none_with_a_warning_on_rank_0():
    import warnings
    from hvdp.outer import NoWarmupWarning, warmup_steps_of
    with pytest.warns(NoWarmupWarning, match="without warmup_steps.*warmup_steps=0 to start outer steps at once"):
        assert warmup_steps_of(None, 0) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: another rank, or a value given (0 included)
        assert warmup_steps_of(None, 1) == 0
        assert warmup_steps_of(0, 0) == 0 and warmup_steps_of(96, 0) == 96


def test_a_fragment_in_flight_cannot_be_saved_and_settings_must_match():
    settings = OuterSettings(sync_every=4, fragments=2, delay=1)
    _, _, saved = run(settings, 4, stop_at=3)  # fragment 0 syncs at 4, fragment 1 at 2: lands at 3
    assert saved[0]["loop"]["step"] == 3
    with pytest.raises(RuntimeError, match="in flight"):
        run(settings, 8, stop_at=4)
    other = OuterSettings(sync_every=8, fragments=2, delay=1)
    with pytest.raises(ValueError, match="same sync_every"):
        run(other, 8, resume=(3, saved))


@pytest.mark.parametrize("kwargs,match", [
    ({"sync_every": 0}, "sync_every must be an integer >= 1"),
    ({"sync_every": 2.5}, "sync_every must be an integer"),
    ({"sync_every": 2, "fragments": 3}, "fragments=3 is more than sync_every=2"),
    ({"sync_every": 4, "delay": 4}, "delay=4 must be below sync_every=4"),
    ({"sync_every": 4, "lr": 0}, "outer lr must be > 0"),
    ({"sync_every": 4, "momentum": 1.0}, r"momentum must be in \[0, 1\)"),
    ({"sync_every": 4, "momentum": 0.0}, "nesterov=True needs momentum > 0"),
    ({"sync_every": 4, "mix": 1.0}, r"mix must be in \[0, 1\)"),
    ({"sync_every": 4, "warmup": -1}, "warmup must be an integer >= 0"),
    ({"sync_every": 4, "warmup_compression": "int8"}, "without warmup_steps"),
    ({"sync_every": 4, "warmup": 2, "warmup_compression": None}, "must be a codec's name"),
    ({"sync_every": "often"}, "sync_every must be an integer >= 1 or 'auto'"),
])
def test_settings_refuse_what_cannot_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OuterSettings(**kwargs)


@pytest.mark.parametrize("step_s,exchange_s,k,delay,want", [
    (0.2, 0.5, 1, 0, 25),     # blocking syncs: 0.5 s per 25 steps of 0.2 s = 10%
    (0.2, 0.5, 2, 1, 6),      # overlapped: each of 2 fragments' 0.5 s under 3 steps
    (1.0, 1e-6, 1, 0, 1),     # a free exchange: every step
    (1.0, 1e-6, 4, 2, 4),     # at least K, above delay
    (0.001, 10.0, 1, 0, 500),  # at most 500
])
def test_auto_chooses_h_from_step_and_exchange(step_s, exchange_s, k, delay, want):
    from hvdp.outer import auto
    assert auto.choose(step_s, exchange_s, k, delay) == want


def ticking():
    """A clock that advances one second per reading: the probe's step and exchange are 1 s each."""
    import itertools
    return lambda: itertools.count().__next__


@pytest.mark.parametrize("k,delay,want", [(1, 0, 10), (2, 1, 2)])
def test_sync_every_auto_probes_then_syncs_every_chosen_h(k, delay, want):
    settings = OuterSettings(sync_every="auto", fragments=k, delay=delay)
    # the ticking clock is read once per inner step and twice per fragment's timed exchange:
    # a step is 1 s apart except the probe's last one (read before its exchanges)
    _, synced, _ = run(settings, 6 + 3 * want, clock=ticking())
    loops = run.loops
    assert all(lp.auto["sync_every"] == want for lp in loops), [lp.auto for lp in loops]
    steps = sorted({s for s, _ in synced[0]})
    frag0 = [s for s in steps if s == 6 or (s - 6) % want == 0]
    assert frag0[:4] == [6, 6 + want, 6 + 2 * want, 6 + 3 * want][:len(frag0)], steps
    if delay == 0:
        assert_ranks_identical_after_syncs(synced)


def test_sync_every_auto_resumes_with_the_chosen_h():
    settings = OuterSettings(sync_every="auto")
    straight, _, saved = run(settings, 30, stop_at=20, clock=ticking())
    assert saved[0]["loop"]["auto"]["sync_every"] == 10
    resumed, _, _ = run(settings, 30, resume=(20, saved), clock=ticking())
    for r in range(P):
        for a, b in zip(straight[r], resumed[r]):
            assert np.array_equal(a, b)
    _, _, probing = run(settings, 4, stop_at=3, clock=ticking())
    assert probing[0]["loop"]["auto"] is None
