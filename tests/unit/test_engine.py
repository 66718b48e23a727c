"""The reduction engine on P simulated workers (numpy ops, in-process collectives): every path
against the exact average, the one statistics shape, re-planning, settings."""
import numpy as np
import pytest

from hvdp import codecs
from hvdp.reduce.collectives import AVERAGE, SUM
from hvdp.reduce.engine import Engine
from hvdp.ops import NumpyOps
from hvdp.reduce.plan import CompressionPolicy
from hvdp.reduce.settings import ReduceSettings, is_two_phase
from hvdp.reduce.simcomm import FakeGroup

OPS = NumpyOps()
SHAPES = [(64, 40), (40,), (40, 30), (30,)]
NAMES = ["l1.w", "l1.b", "l2.w", "l2.b"]
STAT_KEYS = {"last_step", "total", "steps", "phase_ms", "phase_ms_last_step", "paths", "paths_why",
             "codec", "compressed_tensors", "plain_tensors", "hierarchical", "not_counted"}


class NumpyPlain:
    """The framework's plain path, for numpy arrays (casts as hvdp.torch's does)."""

    def __init__(self, comm, op):
        self.comm, self.op = comm, op

    def is_sparse(self, g):
        return False

    def dense(self, g):
        return g

    def submit(self, grads, name, wire):
        out = []
        for i, g in enumerate(grads):
            x = g.astype(wire) if wire not in (None, "float32") else g
            out.append(((self.comm.allreduce_async(x, f"{name}.{i}", self.op), g.dtype), x.nbytes))
        return out

    def finish(self, pending):
        handle, dtype = pending
        return self.comm.wait(handle).astype(dtype)


def gather(comm):
    return lambda data, name: [data] * comm.size  # every rank describes the same


def engines(p, codec, policy=None, op=AVERAGE, **kw):
    settings = ReduceSettings(codecs.get(codec), policy or CompressionPolicy(min_elements=100), op=op)
    group = FakeGroup(p)
    return [Engine(settings, OPS, c, NumpyPlain(c, op), gather(c), **kw) for c in group.comms]


def grads_of(p, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(np.float32) * (r + 1) for s in SHAPES] for r in range(p)]


def step(engs, grads):
    """One step driven as hvdp.torch drives it: every plain tensor and bucket started on every
    rank, then exchanged, then finished."""
    plain = []
    for e, g in zip(engs, grads):
        e.begin_step()
        plain.append({i: e.start_plain([g[i]], NAMES[i])[0] for i in e.plan.plain})
        for b, idx in enumerate(e.plan.buckets):
            e.start_bucket(b, [g[i] for i in idx])
    for e in engs:
        e.exchange_all()
    outs = []
    for e, g, pl in zip(engs, grads, plain):
        out = list(g)
        for i, pend in pl.items():
            out[i] = e.plain.finish(pend)
        for b, flat in e.finish_buckets():
            for i, piece in e.pieces(b, flat):
                out[i] = piece.reshape(SHAPES[i])
        e.end_step()
        outs.append(out)
    return outs


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("codec,tol", [("none", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2), ("int8", 5e-2)])
def test_every_path_against_the_exact_average(p, codec, tol):
    engs = engines(p, codec)
    for e in engs:
        e.set_layout(NAMES, SHAPES, [True] * 4)
    grads = grads_of(p)
    outs = step(engs, grads)
    exact = [np.mean([np.float64(g[i]) for g in grads], axis=0) for i in range(4)]
    scale = max(float(np.abs(x).max()) for x in exact)
    for i in range(4):
        err = float(np.abs(outs[0][i] - exact[i]).max())
        assert err <= tol * scale, f"{codec} P={p} {NAMES[i]}: |out - mean| {err:.3g} > {tol} * {scale:.3g}"
        for r in range(1, p):  # every rank decodes the same bytes
            assert np.array_equal(outs[r][i], outs[0][i]), f"{codec}: rank {r} differs"
    # the biases (< 100 elements) go plain; the weights into a two-phase bucket unless summable
    two_phase = is_two_phase(codecs.get(codec))
    assert engs[0].plan.plain == ((1, 3) if two_phase else (0, 1, 2, 3)), engs[0].plan


def test_sum_and_predivide():
    settings = ReduceSettings(codecs.get("int8"), CompressionPolicy(min_elements=100), op=SUM)
    assert settings.predivide == 1.0
    engs = engines(2, "int8", op=SUM)
    for e in engs:
        e.set_layout(NAMES, SHAPES, [True] * 4)
    grads = grads_of(2, seed=1)
    outs = step(engs, grads)
    exact = grads[0][0] + grads[1][0]
    assert np.abs(outs[0][0] - exact).max() <= 0.05 * np.abs(exact).max()


def test_one_statistics_shape_recorded():
    engs = engines(2, "int8")
    for e in engs:
        e.set_layout(NAMES, SHAPES, [True] * 4)
    step(engs, grads_of(2))
    s = engs[0].summary()
    assert set(s) == STAT_KEYS, set(s) ^ STAT_KEYS
    assert s["steps"] == 1 and s["codec"] == "int8(block_size=256)", s
    assert (s["compressed_tensors"], s["plain_tensors"]) == (2, 2)
    last = s["last_step"]
    assert last["int8"]["tensors"] == 1 and last["none"]["tensors"] == 2, last  # one bucket, 2 biases
    assert last["int8"]["elements"] == 64 * 40 + 40 * 30
    assert 0.2 < last["all"]["ratio"] < 0.35, last["all"]  # int8: about a quarter of float32
    assert s["total"] == last


def test_traced_step_is_counted_per_step():
    """A traced step records its bytes once (the template); summary(steps=) counts it, split at
    the warm-up."""
    engs = engines(1, "int8", policy=CompressionPolicy(min_elements=100, warmup_steps=2), tracing=lambda: True)
    e = engs[0]
    e.set_layout(NAMES, SHAPES, [True] * 4)
    g = grads_of(1)[0]
    e.reduce(g, compress=True)
    e.reduce(g, compress=False)
    e.end_step()  # nothing while traced
    s = e.summary(steps=5)
    assert s["steps"] == 5, s
    n = sum(int(np.prod(x)) for x in SHAPES)
    assert s["total"]["none"]["elements"] == 2 * n + 3 * (40 + 30), s["total"]  # 2 plain steps + biases
    assert s["total"]["int8"]["elements"] == 3 * (64 * 40 + 40 * 30)
    assert set(s["last_step"]) == {"int8", "none", "all"}


def test_replan_keeps_only_the_residuals_of_unchanged_buckets():
    engs = engines(2, "int8", policy=CompressionPolicy(min_elements=100, fusion_threshold_bytes=4 * 2600))
    for e in engs:
        e.set_layout(NAMES, SHAPES, [True] * 4)
    step(engs, grads_of(2))
    before = engs[0].reducer.worker.snapshot()
    assert set(before) == {"b0", "b1"}, before  # l2.w then l1.w: one bucket each
    # l2 frozen: l1.w's bucket is now b0 (other members), the old b0 (l2.w) is gone
    for e in engs:
        e.set_layout(NAMES[:2], SHAPES[:2], [True] * 2)
    assert engs[0].reducer.worker.snapshot() == {}, "a residual moved to another bucket's tensors"
    for e in engs:
        e.set_layout(NAMES, SHAPES, [True] * 4)
    step(engs, grads_of(2, seed=3))
    kept = engs[0].reducer.worker.snapshot()
    for e in engs:  # the same layout again: every residual stays
        e.set_layout(NAMES, SHAPES, [True] * 4)
    again = engs[0].reducer.worker.snapshot()
    assert set(again) == set(kept) and all(np.array_equal(again[k], kept[k]) for k in kept)


def test_auto_with_a_given_table_decides_per_bucket_and_uniformly():
    from hvdp.reduce.auto import CostTable, Line
    links = {k: Line(1e-4, 1e-6) for k in ("allreduce.float32", "allreduce.float16", "alltoall", "allgather")}
    table = CostTable(2, links, {"int8(block_size=256)": Line(0, 1e-12)})
    auto = codecs.Compression.auto.configure(candidates=("int8",), costs=table)
    for per_bucket in (True, False):
        group = FakeGroup(2)
        settings = ReduceSettings(auto, CompressionPolicy(min_elements=100))
        engs = [Engine(settings, OPS, c, NumpyPlain(c, AVERAGE), gather(c), per_bucket_auto=per_bucket)
                for c in group.comms]
        for e in engs:
            e.set_layout(NAMES, SHAPES, [True] * 4)
        step(engs, grads_of(2))
        a = engs[0].summary()["auto"]
        assert a["per_bucket"] is per_bucket and a["decided"], a
        assert {b["codec"] for b in a["buckets"]} == {"int8(block_size=256)"}, a
        assert engs[0].summary()["codec"].startswith("auto("), engs[0].summary()["codec"]


def test_a_bucket_auto_gave_none_goes_plain_tensor_by_tensor():
    """Where auto gives a bucket float32 none, its tensors take the plain path one by one, as
    compression="none" sends them (the same bits, no flat copy, no residuals to check); a
    bucket auto compresses stays a bucket."""
    from hvdp.reduce.auto import CostTable, Line

    def run(codec, per_byte=None):
        if per_byte is None:
            settings = ReduceSettings(codecs.get(codec), CompressionPolicy(min_elements=100))
        else:
            links = {k: Line(1e-4, per_byte) for k in ("allreduce.float32", "allreduce.float16", "alltoall",
                                                        "allgather")}
            table = CostTable(2, links, {"int8(block_size=256)": Line(0, 1e-9)})
            settings = ReduceSettings(codecs.Compression.auto.configure(candidates=("int8",), costs=table),
                                      CompressionPolicy(min_elements=100))
        group = FakeGroup(2)
        engs = [Engine(settings, OPS, c, NumpyPlain(c, AVERAGE), gather(c)) for c in group.comms]
        for e in engs:
            e.set_layout(NAMES, SHAPES, [True] * 4)
            e.begin_step()
        subs = [e.submit(g) for e, g in zip(engs, grads_of(2, 4))]
        for e in engs:  # every rank's second phase before any waits for it
            e.exchange_all()
        outs = [e.complete(sub) for e, sub in zip(engs, subs)]
        for e in engs:
            e.end_step()
        return engs[0], outs[0]

    none_eng, none_out = run("none")
    fast, out = run("auto", per_byte=1e-12)        # a link so fast that int8's work never pays
    assert {b["codec"] for b in fast.summary()["auto"]["buckets"]} == {"none"}, fast.summary()["auto"]
    assert fast.plan.buckets and not any(fast.packs(b) for b in range(len(fast.plan.buckets)))
    assert not fast.keeps_residuals
    assert all(np.array_equal(a, b) for a, b in zip(out, none_out))
    assert fast.summary()["last_step"]["none"]["tensors"] == 4, fast.summary()["last_step"]
    slow, out8 = run("auto", per_byte=1e-6)        # a slow link: int8 pays, the bucket stays one
    assert {b["codec"] for b in slow.summary()["auto"]["buckets"]} == {"int8(block_size=256)"}
    assert all(slow.packs(b) for b in range(len(slow.plan.buckets))) and slow.keeps_residuals
    assert slow.summary()["last_step"]["none"]["tensors"] == 2, slow.summary()["last_step"]


def test_settings_say_what_to_fix():
    with pytest.raises(TypeError, match="CompressionPolicy"):
        ReduceSettings(codecs.get("int8"), policy={"min_elements": 1})
    with pytest.raises(ValueError, match="only supported with op=hvd.Average"):
        ReduceSettings(codecs.get("int8"), CompressionPolicy(), op=SUM, predivide=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step must be >= 1"):
        ReduceSettings(codecs.get("none"), CompressionPolicy(), backward_passes=0)
    s = ReduceSettings(codecs.get("int8"), CompressionPolicy(error_feedback=False))
    assert s.two_phase and not s.error_feedback(s.codec)
    assert ReduceSettings(codecs.get("int8"), CompressionPolicy()).error_feedback(codecs.get("int8"))
    assert not ReduceSettings(codecs.get("fp16"), CompressionPolicy()).two_phase
    h = ReduceSettings(None, CompressionPolicy(), compressor="FP16Compressor")
    assert h.compression == "horovod:FP16Compressor" and not h.two_phase


def test_discard_step_puts_every_residual_back():
    """A step the driver discards (a loss scaler skips it; the overflow may be in a plain tensor
    only, where the buckets cannot see it) leaves every bucket's residuals as the step found them."""
    engs = engines(2, "int8")
    for e in engs:
        e.set_layout(NAMES, SHAPES, [True] * 4)
    step(engs, grads_of(2, seed=1))
    before = [(dict(e.reducer.worker.snapshot()), dict(e.reducer.server.snapshot())) for e in engs]
    assert all(w for w, _ in before) and engs[0].keeps_residuals
    step(engs, grads_of(2, seed=2))
    changed = [not all(np.array_equal(e.reducer.worker.get(k), v) for k, v in w.items())
               for e, (w, _) in zip(engs, before)]
    assert all(changed)
    for e in engs:
        e.discard_step()
    for e, (w, s) in zip(engs, before):
        assert all(np.array_equal(e.reducer.worker.get(k), v) for k, v in w.items())
        assert all(np.array_equal(e.reducer.server.get(k), v) for k, v in s.items())
    assert not engines(2, "none")[0].keeps_residuals


def test_not_counted_is_a_time_proportional_estimate_beside_sent():
    """compression_stats()["not_counted"]: what sent leaves out (Horovod's coordination, framing,
    TCP/IP headers), estimated from the interval between the last two steps; the counted keys
    are unchanged by it, and a traced step (no time measured) gives no estimate."""
    from hvdp.reduce.stats import UNCOUNTED_BYTES_PER_S, WireStats
    w = WireStats()
    w.record_allreduce("none", 10, 40, 2)
    w.end_step()
    nc = w.summary()["not_counted"]
    assert nc["interval_s"] is None and nc["estimate"] is None, nc  # one end: no interval yet
    w.record_allreduce("none", 10, 40, 2)
    w.end_step()
    nc = w.summary()["not_counted"]
    assert nc["interval_s"] >= 0 and nc["estimate"] == nc["interval_s"] * UNCOUNTED_BYTES_PER_S, nc
    assert w.summary()["last_step"]["all"]["sent"] == 40.0  # sent keeps its meaning
    w.add_step({"none": {"tensors": 1, "elements": 10, "handed": 40, "sent": 40.0, "fp32": 40.0}}, 3)
    assert w.summary()["not_counted"]["estimate"] is None


@pytest.mark.parametrize("codec", ["int8", "int4", "topk", "powersgd"])
def test_progress_starts_the_next_phase_early_and_gives_the_same_bits(codec):
    """Engine.progress (hvdp.torch's hooks) starts a bucket's next phase once its first
    collective is done on every rank, and never before; over three steps (residuals carried) the
    results are the same bits as the phases started at step()."""
    policy = CompressionPolicy(min_elements=100, fusion_threshold_bytes=4 * 64 * 40)  # two buckets
    early, late = engines(2, codec, policy), engines(2, codec, policy)
    for e in early + late:
        e.set_layout(NAMES, SHAPES, [True] * 4)
    assert len(early[0].plan.buckets) == 2, early[0].plan
    for s in range(3):
        grads = grads_of(2, seed=s)
        want = step(late, grads)
        early[0].comm.inner.group.board.clear()  # last step's posts would read as done
        for e in early:
            e.begin_step()
            e.start_bucket(0, [grads[e.comm.rank][i] for i in e.plan.buckets[0]])
            e.progress()  # rank 0: rank 1 has not posted b0 yet; rank 1: every rank has
        first = [e._pending[0].phase for e in early]
        assert first == [1, 2], f"{codec}: phase of b0 after each rank's progress: {first}"
        for e in early:
            e.start_bucket(1, [grads[e.comm.rank][i] for i in e.plan.buckets[1]])
            e.progress()  # rank 0's b0 now goes on; b1 waits for rank 1
        assert [e._pending[0].phase for e in early] == [2, 2]
        assert [e._pending[1].phase for e in early] == [1, 2]
        got = []
        for e in early:
            e.exchange_all()
            out = {}  # the buckets' tensors (the plain ones are not in this comparison)
            for b, flat in e.finish_buckets():
                for i, piece in e.pieces(b, flat):
                    out[i] = piece.reshape(SHAPES[i])
            e.end_step()
            got.append(out)
        for r in range(2):
            for b in early[r].plan.buckets:
                for i in b:
                    assert np.array_equal(got[r][i], want[r][i]), f"{codec} step {s} rank {r} {NAMES[i]}"
