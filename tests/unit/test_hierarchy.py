"""The two-level reduction (hvdp.reduce.hierarchy) on simulated nodes: every codec against the exact
float64 average under its bound, ranks bit-identical, none equal to the flat reduction, the
bytes that cross nodes, the residual rules, the topology checks and the settings' refusals."""
import threading
import time

import numpy as np
import pytest

from hvdp import codecs
from hvdp.codecs.auto import Auto
from hvdp.reduce.collectives import AVERAGE, SUM
from hvdp.reduce.engine import Engine
from hvdp.cluster.topology import HierarchyError, static_groups, topology
from hvdp.reduce.hierarchy import HierarchicalReducer
from hvdp.ops import NumpyOps
from hvdp.reduce.plan import CompressionPolicy
from hvdp.reduce.settings import ReduceSettings
from hvdp.reduce.simcomm import FakeGroup
from hvdp.reduce.stats import WireStats
from hvdp.reduce.twophase import TwoPhaseReducer

from test_engine import NumpyPlain, gather

OPS = NumpyOps()
# codec -> bound on |two-level - exact mean| in units of max|g| (one step, no residual yet):
# int8 half a step (block max / 254) at the worker's and at the owner's encoding, each block max
# at most the largest |g| (the share is a node's sum, then divided by L); fp16/bf16 two roundings
BOUNDS = {"none": 1e-6, "fp16": 2 * 2.0 ** -11 * 1.01, "bf16": 2 * 2.0 ** -8 * 1.01, "int8": 1 / 127 * 1.001}


def cluster(nodes, width, codec, ef=None, op=AVERAGE, stats=False):
    """Reducers of a nodes x width cluster, ranks numbered node by node."""
    locals_ = [FakeGroup(width, blocking=True) for _ in range(nodes)]
    crosses = [FakeGroup(nodes, blocking=True) for _ in range(width)]
    c = codecs.get(codec)
    ef = c.error_feedback_default if ef is None else ef
    return [HierarchicalReducer(c, OPS, locals_[r // width].comms[r % width], crosses[r % width].comms[r // width],
                                ef, op, 1.0, WireStats() if stats else None)
            for r in range(nodes * width)]


def run(reducers, flats, name="b0"):
    """One reduction on every rank, each in its own thread (the levels wait on each other)."""
    out, errors = [None] * len(reducers), []

    def one(r):
        try:
            pend = reducers[r].start(name, flats[r])
            reducers[r].exchange(pend)
            out[r] = reducers[r].finish(pend)
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)
    run_threads(one, len(reducers), errors)
    return out


def run_threads(fn, n, errors, timeout=120):
    """``fn(r)`` for r in 0..n-1, each on its own thread (simulated ranks whose collectives
    block until all have posted); the first error any raised (into ``errors``) is raised here."""
    threads = [threading.Thread(target=fn, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]


def grads(p, n, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * (1 + r)).astype(np.float32) for r in range(p)]


@pytest.mark.parametrize("nodes,width", [(2, 2), (3, 2), (2, 3), (1, 2), (2, 1)])
@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
def test_every_codec_against_the_exact_average(nodes, width, codec):
    p, n = nodes * width, 5003  # not a multiple of any chunk: the padding is exercised
    g = grads(p, n)
    out = run(cluster(nodes, width, codec), g)
    exact = np.mean([x.astype(np.float64) for x in g], axis=0)
    gmax = max(float(np.abs(x).max()) for x in g)
    err = float(np.abs(out[0] - exact).max())
    assert out[0].shape == (n,) and out[0].dtype == np.float32
    assert err <= BOUNDS[codec] * gmax, f"{codec} {nodes}x{width}: {err:.3g} > {BOUNDS[codec]:.3g} * {gmax:.3g}"
    for r in range(1, p):
        assert np.array_equal(out[r], out[0]), f"{codec}: rank {r} differs from rank 0"


def test_topk_two_level_sends_its_share_and_matches_its_flat_error():
    """Top-k keeps k of each chunk: not bounded per element, but every rank identical and the
    error no larger than the flat two-phase reduction's on the same gradients (x1.5)."""
    nodes, width, n = 2, 2, 4096
    g = grads(nodes * width, n, seed=3)
    out = run(cluster(nodes, width, "topk"), g)
    flat_group = FakeGroup(nodes * width, blocking=True)
    flat = run([TwoPhaseReducer(codecs.get("topk"), OPS, c, False) for c in flat_group.comms], g)
    exact = np.mean([x.astype(np.float64) for x in g], axis=0)
    for r in range(1, len(out)):
        assert np.array_equal(out[r], out[0])
    assert np.linalg.norm(out[0] - exact) <= 1.5 * np.linalg.norm(flat[0] - exact)


def test_none_equals_the_flat_reduction_within_float32_rounding():
    nodes, width, n = 2, 2, 3001
    g = grads(nodes * width, n, seed=1)
    two = run(cluster(nodes, width, "none"), g)
    flat = np.mean(np.stack(g), axis=0, dtype=np.float32)
    assert np.allclose(two[0], flat, rtol=0, atol=4 * np.finfo(np.float32).eps * float(np.abs(flat).max()))


def test_sum_op():
    g = grads(4, 1000, seed=2)
    out = run(cluster(2, 2, "none", op=SUM), g)
    assert np.allclose(out[0], np.sum(g, axis=0), atol=1e-4)


def test_bytes_across_nodes_are_one_local_share():
    """int8: the cross step carries 1/L of the bucket per rank; none: 4 bytes per element of it."""
    nodes, width, n = 2, 2, 1 << 14
    for codec, per_element in (("int8", 1.0), ("none", 4.0)):
        reds = cluster(nodes, width, codec, stats=True)
        run(reds, grads(4, n))
        for red in reds:
            red.stats.end_step()
        row = reds[0].stats.summary()["last_step"][codec]
        share = n // width
        # the cross ring / two-phase sends 2 (C-1)/C of the share's payload (plus int8's scales)
        expect = 2 * (nodes - 1) / nodes * share * per_element
        assert expect <= row["cross"] <= expect * 1.1, (codec, row)
        # flat: of each rank's P-1 peers, P-L are on other nodes; each gets a 1/P chunk, twice
        p = nodes * width
        flat_cross = 2 * (p - width) / p * n * per_element
        assert row["cross"] / flat_cross <= 1 / width * 1.1, (codec, row["cross"], flat_cross)


def test_error_feedback_residuals_follow_the_share_and_the_node_layout():
    reds = cluster(2, 2, "int8", ef=True)
    g = grads(4, 2048, seed=4)
    run(reds, g)
    state = reds[1].state_dict()
    c, padded = reds[1].layout(2048)
    assert state["levels"] == [2, 2, 1]
    assert OPS.size(state["worker"]["b0"]) == padded and OPS.size(state["server"]["b0"]) == c
    # accumulated error stays bounded over steps (error feedback at both levels)
    total_out, total_in = np.zeros(2048), np.zeros(2048)
    for s in range(20):
        g = grads(4, 2048, seed=10 + s)
        out = run(reds, g)
        total_out += out[0]
        total_in += np.mean([x.astype(np.float64) for x in g], axis=0)
    gmax = max(float(np.abs(x).max()) for x in g) * 4
    assert float(np.abs(total_out - total_in).max()) <= 3 * gmax / 127
    # another node layout (or another local rank): the residuals start from zero
    other = cluster(4, 1, "int8", ef=True)[1]
    other.load_state_dict(state)
    assert other.worker.snapshot() == {} and other.server.snapshot() == {}
    same = cluster(2, 2, "int8", ef=True)[1]
    same.load_state_dict(state)
    assert np.array_equal(same.worker.get("b0"), state["worker"]["b0"])


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_engine_runs_two_levels_and_says_so(codec):
    """The engine with hierarchical settings buckets every codec (none too) into the two-level
    reducer, and says so in the ranks-agree description and the statistics."""
    nodes, width = 2, 2
    locals_ = [FakeGroup(width, blocking=True) for _ in range(nodes)]
    crosses = [FakeGroup(nodes, blocking=True) for _ in range(width)]
    world = FakeGroup(4, blocking=True)
    settings = ReduceSettings(codecs.get(codec), CompressionPolicy(min_elements=100), hierarchical=True)
    engs = [Engine(settings, OPS, world.comms[r], NumpyPlain(world.comms[r], AVERAGE), gather(world.comms[r]),
                   levels=lambda r=r: (locals_[r // width].comms[r % width], crosses[r % width].comms[r // width]))
            for r in range(4)]
    shapes = [(64, 40), (40,)]
    for e in engs:
        e.set_layout(["w", "b"], shapes, [True, True])
        assert e.plan.buckets == ((0,),) and e.plan.plain == (1,)
        assert isinstance(e.reducer, HierarchicalReducer), type(e.reducer)
        assert e.describe([])["settings"]["hierarchical"] == "True"
        assert e.summary()["hierarchical"] == "2 nodes x 2 ranks"
    g = [[np.full(s, r + 1.0, np.float32) for s in shapes] for r in range(4)]
    out = [None] * 4

    def one(r):
        e = engs[r]
        pl = e.start_plain([g[r][1]], "b")[0]
        e.start_bucket(0, [g[r][0]])
        e.exchange_all()
        out[r] = (dict(e.finish_buckets())[0], e.plain.finish(pl))
        e.end_step()
    ts = [threading.Thread(target=one, args=(r,)) for r in range(4)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    for r in range(4):
        assert np.allclose(out[r][0], 2.5, rtol=1e-2) and np.allclose(out[r][1], 2.5)
    s = engs[0].summary()
    assert s["last_step"][codec]["cross"] > 0 and s["last_step"]["all"]["cross"] > 0


def test_topology_from_ranks_and_its_refusals():
    t = topology([(0, 0), (0, 1), (1, 0), (1, 1)])
    assert t.local == ((0, 1), (2, 3)) and t.cross == ((0, 2), (1, 3))
    assert t.groups() == [[0, 1], [2, 3], [0, 2], [1, 3]]
    # ranks interleaved across hosts are served as they are
    assert topology([(0, 0), (1, 0), (0, 1), (1, 1)]).local == ((0, 2), (1, 3))
    with pytest.raises(HierarchyError, match=r"uneven .*node 0: 3, node 1: 1.*-H a:2,b:2"):
        topology([(0, 0), (0, 1), (0, 2), (1, 0)])
    with pytest.raises(HierarchyError, match="both say they are local rank 0"):
        topology([(0, 0), (0, 0)])
    assert static_groups({"HOROVOD_SIZE": "4", "HOROVOD_LOCAL_SIZE": "2"}).cross == ((0, 2), (1, 3))
    assert static_groups({"OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}).local_size == 3
    assert static_groups({}) is None
    with pytest.raises(HierarchyError, match="uneven"):
        static_groups({"HOROVOD_SIZE": "5", "HOROVOD_LOCAL_SIZE": "2"})


@pytest.mark.parametrize("kw,match", [
    (dict(codec=None, compressor="FP16Compressor"), "not a Horovod compressor"),
    (dict(codec=Auto()), "auto"),
    (dict(uneven_inputs=True), "uneven_inputs"),
])
def test_settings_refuse_what_two_levels_cannot_run(kw, match):
    args = dict(codec=codecs.get("int8"), policy=CompressionPolicy(), hierarchical=True)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ReduceSettings(**args)


class _FakeSets:
    """What make_levels needs of an adapter's Horovod (hvdp.cluster.mesh.HorovodSets), recording adds."""

    def __init__(self, rank, size):
        from hvdp.cluster.mesh import HorovodSets
        self.added = []

        class PS:
            def __init__(s, ranks):
                s.ranks, s.process_set_id = list(ranks), None

        def add(ps):
            ps.process_set_id = len(self.added) + 1
            self.added.append(ps.ranks)
            return ps
        self.hv = HorovodSets(lambda: rank, lambda: size, PS, add, "GLOBAL")


def test_make_levels_adds_the_sets_or_says_how(monkeypatch):
    from hvdp.cluster import mesh
    from hvdp.cluster.topology import make_levels
    monkeypatch.setattr(mesh, "_KNOWN", {})
    places = [(0, 0), (0, 1), (1, 0), (1, 1)]
    gather = lambda data, name: [np.array(p, "<i4").tobytes() for p in places]  # noqa: E731
    f = _FakeSets(rank=2, size=4)
    with pytest.raises(HierarchyError, match=r"dynamic process sets are off.*hvd.hierarchical_process_sets\(\)"):
        make_levels(f.hv, 1, 0, gather, lambda ps: ps, environ={})
    local, cross, topo = make_levels(f.hv, 1, 0, gather, lambda ps: ps,
                                     environ={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert f.added == [[0, 1], [2, 3], [0, 2], [1, 3]]  # every rank adds every set, in one order
    assert (local.ranks, cross.ranks) == ([2, 3], [0, 2])
    with pytest.raises(HierarchyError, match="elastic"):
        make_levels(f.hv, 1, 0, gather, lambda ps: ps, environ={"HOROVOD_ELASTIC": "1"})
    with pytest.raises(HierarchyError, match="process_set="):
        make_levels(f.hv, 1, 0, gather, lambda ps: ps, process_set=type("P", (), {"process_set_id": 3})(),
                    environ={})


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_progress_runs_both_levels_ahead_with_the_same_bits(codec):
    """``progress`` (hvdp.torch's hooks) starts the cross step once the node's shares are in, and
    the cross step's second phase once its first is done, never waiting; over two steps
    (residuals carried) the results are the bits of the phases started at finish."""
    nodes, width, n = 2, 2, 3000
    ahead, plain = cluster(nodes, width, codec), cluster(nodes, width, codec)
    phases = [None] * (nodes * width)
    for s in range(2):
        flats = grads(nodes * width, n, seed=s)
        want = run(plain, flats)
        got, errors = [None] * len(ahead), []

        def one(r):
            try:
                red = ahead[r]
                pend = red.start("b0", flats[r])
                deadline = time.monotonic() + 30
                while pend.phase == 1 or (codec != "none" and pend.inner.phase == 1):
                    red.progress(pend)
                    assert time.monotonic() < deadline, f"rank {r}: progress never got past phase {pend.phase}"
                    time.sleep(0.001)
                phases[r] = (pend.phase, getattr(pend.inner, "phase", None))
                red.advance(pend)
                got[r] = red.finish(pend)
            except BaseException as e:  # reported below, on the test's thread
                errors.append(e)
        run_threads(one, len(ahead), errors)
        for r in range(len(ahead)):
            assert phases[r] == (2, None if codec == "none" else 2), phases
            assert np.array_equal(got[r], want[r]), f"{codec} step {s} rank {r}"
