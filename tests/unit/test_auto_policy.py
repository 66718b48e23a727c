"""compression="auto": the pure decision on fake cost tables, the probe's plumbing, and the
per-bucket reducer against the fixed codecs' reducers (numpy reference, simulated workers)."""
import struct

import numpy as np
import pytest

from hvdp import codecs
from hvdp.reduce.auto import CostTable, Line, decide, decide_uniform, predict
from hvdp.reduce.chooser import Chooser
from hvdp.codecs import Compression
from hvdp.codecs.auto import Auto
from hvdp.codecs.resolve import resolve
from hvdp.reduce.mixed import MixedReducer
from hvdp.ops import NumpyOps
from hvdp.reduce import chooser
from hvdp.reduce.probe import LoopbackComm, measure
from hvdp.reduce.simcomm import FakeGroup
from hvdp.reduce.twophase import TwoPhaseReducer

OPS = NumpyOps()
NONE, FP16, BF16, INT8, TOPK = (codecs.get(n) for n in ("none", "fp16", "bf16", "int8", "topk"))
DEFAULT = Auto().candidates


def table(p=2, gbit=1.0, latency=1e-3, fp16_ns=0.5, bf16_ns=1.0, int8_ns=2.0, topk_ns=20.0,
          codec_fixed=2e-4, fp16_sum_slowdown=1.0):
    """A link of ``gbit`` Gbit/s per direction (ring: 2(P-1)/P of the buffer crosses it) and
    codecs costing ``*_ns`` per element."""
    per_byte = 8 / (gbit * 1e9)
    ring = 2 * (p - 1) / p
    links = {"allreduce.float32": Line(latency, ring * per_byte),
             "allreduce.float16": Line(latency, ring * per_byte * fp16_sum_slowdown),
             "alltoall": Line(latency, (p - 1) / p * per_byte),    # x: the P-chunk send buffer
             "allgather": Line(latency, (p - 1) * per_byte)}       # x: this rank's own chunk
    compute = {str(FP16): Line(codec_fixed, fp16_ns * 1e-9), str(BF16): Line(codec_fixed, bf16_ns * 1e-9),
               str(INT8): Line(codec_fixed, int8_ns * 1e-9), str(TOPK): Line(codec_fixed, topk_ns * 1e-9)}
    return CostTable(p, links, compute)


def names(choices):
    return {b: c.codec.name for b, c in choices.items()}


def test_one_worker_sends_nothing_so_none_everywhere():
    got = decide({"b0": 10, "b1": 50_000_000}, DEFAULT, table(p=1, gbit=0.001))
    assert names(got) == {"b0": "none", "b1": "none"}


def test_tiny_buckets_and_fast_links_stay_uncompressed():
    # 100 Gbit/s: the wire of a 26 MB bucket costs less than any codec's work on it
    assert names(decide({"b0": 6_500_000}, DEFAULT, table(gbit=100.0))) == {"b0": "none"}
    # 1 Gbit/s but a 1024-element bucket: two sequential collectives' latency outweigh 3 KB saved
    assert names(decide({"b0": 1024}, DEFAULT, table(gbit=1.0))) == {"b0": "none"}


def test_huge_buckets_on_slow_links_get_int8():
    got = decide({"b0": 4_000_000, "b1": 300}, DEFAULT, table(gbit=1.0))
    assert names(got) == {"b0": "int8", "b1": "none"}
    pred = got["b0"].predicted
    assert pred[str(INT8)] < pred[str(BF16)] < pred[str(NONE)]


def test_middle_link_prefers_a_cast_when_int8_work_outweighs_its_savings():
    # 10 Gbit/s with an int8 codec at 20 ns/element: half the bytes for 0.5 ns beats a quarter for 20
    got = decide({"b0": 4_000_000}, DEFAULT, table(gbit=10.0, int8_ns=20.0))
    assert names(got) == {"b0": "fp16"}
    # Horovod's fp16 sum slower than its float32 one (measured in the probe): bf16 instead
    got = decide({"b0": 4_000_000}, DEFAULT, table(gbit=10.0, int8_ns=20.0, fp16_sum_slowdown=3.0))
    assert names(got) == {"b0": "bf16"}


def test_decision_matches_the_model_exactly():
    t = table(gbit=1.0)
    n = 1_000_003
    c = -(-n // 2 // 256) * 256  # int8 chunk of P=2, aligned to the block
    nb = c + 4 * (c // 256)
    expect = (t.links["alltoall"](2 * nb) + t.links["allgather"](nb) + t.compute[str(INT8)](n))
    assert predict(INT8, n, t) == pytest.approx(expect, rel=1e-12)
    assert predict(NONE, n, t) == pytest.approx(t.links["allreduce.float32"](4 * n), rel=1e-12)
    assert predict(FP16, n, t) == pytest.approx(t.links["allreduce.float16"](2 * n)
                                                + t.compute[str(FP16)](n), rel=1e-12)


def test_ties_go_to_less_work_deterministically():
    flat = CostTable(2, {k: Line(1e-3, 0.0) for k in ("allreduce.float32", "allreduce.float16")}
                     | {k: Line(0.5e-3, 0.0) for k in ("alltoall", "allgather")},
                     {str(c): Line(0.0, 0.0) for c in (FP16, BF16, INT8)})
    # every candidate predicts exactly 1 ms: none (no codec work) wins, in any candidate order
    for order in (DEFAULT, tuple(reversed(DEFAULT))):
        assert names(decide({"b0": 1 << 20}, order, flat)) == {"b0": "none"}
    # without none among the candidates passed in: the codec of least measured work, then by name
    work = CostTable(2, flat.links, {str(FP16): Line(0, 0), str(BF16): Line(0, 0), str(INT8): Line(0, 0)})
    assert names(decide({"b0": 1 << 20}, (INT8, BF16), work)) == {"b0": "bf16"}
    # within the margin a less-work codec is kept: int8 2% faster than none is not worth it
    t = table(gbit=1.0)
    n = 2_000_000
    none_t, int8_t = predict(NONE, n, t), predict(INT8, n, t)
    assert names(decide({"b0": n}, (NONE, INT8), t, margin=none_t / int8_t - 1 + 1e-9)) == {"b0": "none"}
    assert names(decide({"b0": n}, (NONE, INT8), t, margin=0.0)) == {"b0": "int8"}


def test_one_codec_for_all_buckets():
    # a huge bucket on a slow link outweighs many tiny ones: int8 for all
    codec, total = decide_uniform({"b0": 4_000_000, "b1": 300, "b2": 500}, DEFAULT, table(gbit=1.0))
    assert codec.name == "int8" and min(total, key=total.get) == str(INT8)
    # only tiny buckets: none; one worker: none without predictions
    assert decide_uniform({"b0": 300, "b1": 2000}, DEFAULT, table(gbit=1.0))[0].name == "none"
    assert decide_uniform({"b0": 4_000_000}, DEFAULT, table(p=1)) == (NONE, {})


def test_topk_only_when_listed():
    t = table(gbit=0.1, topk_ns=2.0)  # a very slow link: topk (1% of the values) would win
    assert "topk" not in {c.name for c in Auto().candidates}
    assert names(decide({"b0": 4_000_000}, Auto().candidates, t)) == {"b0": "int8"}
    listed = Compression.auto.configure(candidates=("int8", Compression.topk.configure(ratio=0.01)))
    assert [c.name for c in listed.candidates] == ["none", "int8", "topk"]  # none is always there
    assert names(decide({"b0": 4_000_000}, listed.candidates, t)) == {"b0": "topk"}


def test_int4_only_when_listed():
    """int4 changes convergence: never a default candidate; chosen where listed and fastest."""
    int4 = codecs.get("int4")
    assert "int4" not in {c.name for c in Auto().candidates}
    t = table(gbit=0.1)
    t = CostTable(t.world, t.links, dict(t.compute, **{str(int4): t.compute[str(INT8)]}))  # int8's work
    assert names(decide({"b0": 4_000_000}, Auto().candidates, t)) == {"b0": "int8"}
    listed = Compression.auto.configure(candidates=("int8", "int4"))
    assert [c.name for c in listed.candidates] == ["none", "int8", "int4"]
    assert names(decide({"b0": 4_000_000}, listed.candidates, t)) == {"b0": "int4"}


def test_invalid_candidates_name_the_valid_ones():
    with pytest.raises(ValueError, match=r"auto candidate 'int9'.*valid names: bf16, fp16, int4, int8, none, "):
        Auto(candidates=("none", "int9"))
    with pytest.raises(ValueError, match="auto cannot be its own candidate"):
        Auto(candidates=("auto",))
    with pytest.raises(ValueError, match="margin"):
        Auto(margin=1.5)
    with pytest.raises(ValueError, match="trial_steps"):
        Auto(trial_steps=-1)
    with pytest.raises(ValueError, match=r"no codec 'topk\(ratio=0.01\)'.*probe with the same candidates"):
        decide({"b0": 10_000}, (NONE, TOPK), CostTable(2, table().links, {}))


def test_resolve_and_the_agreement_string():
    auto, comp = resolve("auto", Compression, allow_auto=True)
    assert comp is None and isinstance(auto, Auto)
    assert resolve(Compression.auto, Compression, allow_auto=True)[0] is Compression.auto
    with pytest.raises(ValueError, match="not supported by this adapter"):
        resolve("auto", Compression)
    # the digest covers the settings, not one rank's measurements
    assert str(Auto()) == "auto(candidates=[none,fp16,bf16,int8(block_size=256)], margin=0.05, trial_steps=3)"
    fixed = Auto(costs=table())
    assert str(fixed) == str(Auto(costs=CostTable.from_dict(table().as_dict())))
    assert str(fixed) != str(Auto())


def test_line_fit():
    assert Line.fit([(0, 1.0), (10, 3.0)]) == Line(1.0, 0.2)
    assert Line.fit([(1, 2.0), (3, 2.0), (5, 2.0)]) == Line(2.0, 0.0)
    assert Line.fit([(1, 5.0), (10, 1.0)]).slope == 0.0          # noise: never a negative slope
    ln = Line.fit([(1, 0.0), (2, 5.0)])                          # never a negative fixed cost
    assert ln.fixed == 0.0 and ln.slope > 0


def test_probe_plumbing_and_how_ranks_combine():
    comm = LoopbackComm(2, 0, OPS)
    clock = iter(float(i) for i in range(10_000))   # each reading one second later

    def gather(data, name):  # another rank three times slower on every entry
        k = len(data) // 8
        mine = struct.unpack(f"<{k}d", data)
        return [data, struct.pack(f"<{k}d", *[3 * t for t in mine])]

    make = lambda c, cm: TwoPhaseReducer(c, OPS, cm, True)  # noqa: E731
    t = measure(comm, OPS, None, [3000, 70_000], (NONE, FP16, INT8), make, gather,
                reps=2, clock=lambda: next(clock))
    assert t.world == 2
    assert set(t.links) == {"allreduce.float32", "allreduce.float16", "alltoall", "allgather"}
    assert set(t.compute) == {str(FP16), str(INT8)}
    # every timed run took one tick (1 s) on this rank, 3 s on the other: the fastest is kept
    # (noise only adds time), the same on every rank
    for ln in list(t.links.values()) + list(t.compute.values()):
        assert ln.fixed == pytest.approx(1.0) and ln.slope == 0.0
    assert t.probe_s > 0


class _PacedLoopback(LoopbackComm):
    """A loop-back comm on a fake clock: each collective takes 1 ms + per_byte x its buffer."""

    def __init__(self, per_byte):
        super().__init__(2, 0, OPS)
        self.now, self.per_byte, self.sizes = 0.0, per_byte, []

    def _pace(self, buf):
        self.sizes.append(buf.nbytes)
        self.now += 1e-3 + self.per_byte * buf.nbytes

    def allreduce_async(self, x, name, op, prescale=1.0, postscale=1.0):
        self._pace(x)
        return super().allreduce_async(x, name, op, prescale, postscale)

    def alltoall_async(self, buf, name):
        self._pace(buf)
        return super().alltoall_async(buf, name)

    def allgather_async(self, buf, name):
        self._pace(buf)
        return super().allgather_async(buf, name)


@pytest.mark.parametrize("per_byte,bucket_sized", [(1e-7, False), (1e-10, True)])
def test_probe_runs_bucket_sized_collectives_only_on_a_fast_link(per_byte, bucket_sized):
    """On a slow link (1 MiB: 0.1 s) the probe stops at its second size, which shows the per-byte
    cost already; on a fast one it also runs the bucket-sized collectives. Either way the lines
    are the link's."""
    comm = _PacedLoopback(per_byte)
    make = lambda c, cm: TwoPhaseReducer(c, OPS, cm, True)  # noqa: E731
    t = measure(comm, OPS, None, [2_000_000], (NONE, FP16, INT8), make, lambda data, name: [data, data],
                clock=lambda: comm.now)
    assert (max(comm.sizes) > 4 * 2**20) is bucket_sized, max(comm.sizes)
    assert max(comm.sizes) <= 8 * 2**20
    for key, ln in t.links.items():
        assert ln.fixed == pytest.approx(1e-3, rel=1e-6) and ln.slope == pytest.approx(per_byte, rel=1e-6), (key, ln)


def _reduce(reducers, grads, name):
    pend = [r.start(name, g) for r, g in zip(reducers, grads)]
    for r, p in zip(reducers, pend):
        r.exchange(p)
    return [r.finish(p) for r, p in zip(reducers, pend)]


@pytest.mark.parametrize("p", [1, 2, 3])
def test_mixed_reducer_equals_the_fixed_codecs(p):
    rng = np.random.default_rng(p)
    g = FakeGroup(p)
    mixed = [MixedReducer(OPS, c, lambda codec, cm: TwoPhaseReducer(codec, OPS, cm, True)) for c in g.comms]
    for r in mixed:
        r.assign({"b0": INT8, "b1": NONE, "b2": FP16, "b3": BF16})
    fixed = {c.name: [TwoPhaseReducer(c, OPS, cm, True) for cm in FakeGroup(p).comms] for c in (INT8, BF16)}
    for step in range(3):  # error feedback carries over steps
        grads = {b: [rng.standard_normal(1000 + 7 * i).astype(np.float32) for _ in range(p)]
                 for i, b in enumerate(("b0", "b1", "b2", "b3"))}
        out = {b: _reduce(mixed, grads[b], b) for b in grads}
        for b, codec in (("b0", "int8"), ("b3", "bf16")):
            ref = _reduce(fixed[codec], grads[b], b)
            for a, e in zip(out[b], ref):
                np.testing.assert_array_equal(a, e)
        exact = np.mean(grads["b1"], axis=0)
        half = np.mean([x.astype(np.float16) for x in grads["b2"]], axis=0)
        for r in range(p):
            np.testing.assert_allclose(out["b1"][r], exact, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(out["b2"][r], half, rtol=1e-3, atol=1e-3)
            assert out["b2"][r].dtype == np.float32
    assert set(mixed[0].worker_residual) == {"b0", "b3"}
    state = mixed[0].state_dict()
    saved = {k: v.copy() for k, v in mixed[0].worker_residual.items()}
    assert state["choice"]["b3"] == str(BF16)
    # a new decision keeps a bucket's residual only where its codec is unchanged
    mixed[0].assign({"b0": INT8, "b1": NONE, "b2": FP16, "b3": INT8})
    assert set(mixed[0].worker_residual) == {"b0"}
    mixed[0].worker.restore({})
    mixed[0].load_state_dict(state)  # b3 was bf16 when saved, int8 now: not restored
    assert set(mixed[0].worker_residual) == {"b0"}
    np.testing.assert_array_equal(mixed[0].worker_residual["b0"], saved["b0"])


def test_mixed_reducer_without_a_decision_says_so():
    r = MixedReducer(OPS, FakeGroup(2).comms[0], lambda c, cm: TwoPhaseReducer(c, OPS, cm, True))
    with pytest.raises(RuntimeError, match="no codec: the auto decision was not made"):
        r.start("b0", np.zeros(4, np.float32))


class _Recorder:
    """Stands in for the reducer: remembers what it was told to run."""

    def __init__(self):
        self.runs = []

    def assign(self, choice):
        self.runs.append({b: c.name for b, c in choice.items()})


def _drive(settings, step_s, other_rank_s=None, world=2, steps=14, buckets=None):
    """Run a chooser for ``steps`` steps whose time is ``step_s(codec names)``."""
    ch, red = Chooser(settings), _Recorder()
    probes = []

    def probe(sizes):
        probes.append(dict(sizes))
        return table(p=world, gbit=1.0)

    def gather(data, name):  # the other rank: its times scaled by other_rank_s
        k = len(data) // 8
        mine = struct.unpack(f"<{k}d", data)
        return [data, struct.pack(f"<{k}d", *[t * (other_rank_s or 1.0) for t in mine])]

    now = 0.0
    for _ in range(steps):
        ch.ensure(buckets or {"b0": 4_000_000, "b1": 300}, red, world, probe, gather)
        now += step_s(red.runs[-1])
        ch.step_done(now)
    return ch, red, probes


@pytest.fixture
def every_plan(monkeypatch):
    """The trial's mechanics alone: every plan is tried, however slow the model predicts it."""
    monkeypatch.setattr(chooser, "TRY_WITHIN", float("inf"))


def test_trial_keeps_a_proposal_that_is_faster(every_plan):
    ch, red, probes = _drive(Auto(trial_steps=3), lambda run: 0.1 if run["b0"] == "int8" else 0.2)
    assert len(probes) == 1
    # none from the probe's step on (K=3 timed steps after it), K steps with the proposal (int8),
    # K with the runner-up (the model's next best for the big bucket: fp16), then the proposal
    assert [r["b0"] for r in red.runs] == ["none", "int8", "fp16", "int8"]
    assert all(r["b1"] == "none" for r in red.runs)  # the tiny bucket: none in every plan
    assert ch.settled and ch.trial["kept"] == "proposal"
    assert ch.trial["ms"] == pytest.approx({"none": 200, "proposal": 100, "runner-up": 200})
    assert [c.codec.name for c in ch.choices.values()] == ["int8", "none"]


def test_trial_keeps_the_runner_up_when_the_steps_say_so(every_plan):
    times = {"none": 0.2, "int8": 0.15, "fp16": 0.1}
    ch, red, _ = _drive(Auto(trial_steps=2), lambda run: times[run["b0"]])
    assert ch.trial["kept"] == "runner-up" and red.runs[-1] == {"b0": "fp16", "b1": "none"}


def test_trial_returns_to_none_when_the_proposal_is_slower_or_within_the_margin(every_plan):
    ch, red, _ = _drive(Auto(trial_steps=3), lambda run: 0.3 if run["b0"] == "int8" else 0.2)
    assert ch.trial["kept"] == "none" and red.runs[-1] == {"b0": "none", "b1": "none"}
    ch, red, _ = _drive(Auto(trial_steps=3, margin=0.05), lambda run: 0.196 if run["b0"] != "none" else 0.2)
    assert ch.trial["kept"] == "none"  # 2% faster: not worth compressing


def test_trial_takes_the_slowest_rank(every_plan):
    # this rank is faster with int8, but the other rank's steps take 3x as long under int8 only
    ch = Chooser(Auto(trial_steps=2))
    red = _Recorder()

    def gather(data, name):  # plans none, proposal, runner-up, 2 steps each
        mine = struct.unpack("<6d", data)
        return [data, struct.pack("<6d", *[3 * t if i in (2, 3) else t for i, t in enumerate(mine)])]

    now = 0.0
    for _ in range(10):
        ch.ensure({"b0": 4_000_000}, red, 2, lambda s: table(gbit=1.0), gather)
        now += {"none": 0.2, "int8": 0.1, "fp16": 0.25}[red.runs[-1]["b0"]]
        ch.step_done(now)
    assert ch.trial["kept"] == "none" and ch.trial["ms"]["proposal"] == pytest.approx(300)


def test_plans_predicted_far_slower_than_the_proposal_are_not_tried():
    """At 1 Gbit/s the model predicts none at 3x int8 (129 against 43 ms): the trial runs the
    proposal and the runner-up (fp16, 1.6x) only; where the runner-up is also predicted over
    2x, there is no trial at all."""
    ch, red, _ = _drive(Auto(trial_steps=2), lambda run: 0.1 if run["b0"] == "int8" else 0.2, steps=8)
    assert [r["b0"] for r in red.runs] == ["int8", "fp16", "int8"], red.runs
    assert ch.settled and ch.trial["kept"] == "proposal" and set(ch.trial["ms"]) == {"proposal", "runner-up"}
    assert set(ch.trial["untried"]) == {"none"} and ch.trial["untried"]["none"] == pytest.approx(129, rel=0.01)
    slow_casts = table(gbit=1.0, fp16_ns=30.0, bf16_ns=30.0)
    ch = Chooser(Auto(trial_steps=2))
    red = _Recorder()
    ch.ensure({"b0": 4_000_000}, red, 2, lambda s: slow_casts, lambda d, n: [d, d])
    assert ch.settled and red.runs == [{"b0": "int8"}], red.runs
    assert ch.trial["steps"] == 0 and set(ch.trial["untried"]) == {"none", "runner-up"}, ch.trial


def test_no_trial_without_compression_or_when_told():
    ch, red, probes = _drive(Auto(), lambda run: 0.1, buckets={"b0": 300})  # proposal: none
    assert ch.settled and ch.trial is None and all(r == {"b0": "none"} for r in red.runs) and len(probes) == 1
    ch, red, _ = _drive(Auto(trial_steps=0), lambda run: 0.1)
    assert red.runs == [{"b0": "int8", "b1": "none"}] and ch.settled
    ch, red, probes = _drive(Auto(costs=table(gbit=1.0)), lambda run: 0.1)  # a given table: no probe
    assert probes == [] and red.runs == [{"b0": "int8", "b1": "none"}]
    ch, red, probes = _drive(Auto(), lambda run: 0.1, world=1)  # one worker: none, no probe
    assert probes == [] and red.runs == [{"b0": "none", "b1": "none"}]


def test_invalidate_probes_and_tries_again(every_plan):
    ch, red, probes = _drive(Auto(trial_steps=1), lambda run: 0.1 if run["b0"] == "int8" else 0.2, steps=8)
    assert ch.settled and len(probes) == 1
    ch.invalidate()
    ch.ensure({"b0": 4_000_000}, red, 2, lambda s: probes.append(s) or table(gbit=1.0), lambda d, n: [d])
    assert len(probes) == 2 and ch.phase == 0 and red.runs[-1]["b0"] == "none"
