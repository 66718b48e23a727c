"""The measurement behind ``compression="auto"``: a short probe of the job's own collectives and
codecs, fitted into an :class:`hvdp.reduce.auto.CostTable` that is the same on every rank.

What it runs (the adapter passes its collectives, array ops and a reducer factory in, so the
probe times exactly the paths training will take):

- links: Horovod allreduce of float32 and of float16, alltoall and allgather of bytes, under the
  optimizer's own process set and names, each at a small size (the fixed cost) and a larger one
  (the per-byte cost). The float32 allreduce goes first, at the small size and one of at most
  ``MID_PROBE_BYTES``: where that run took under ``CHEAP_S`` (a fast link, whose per-byte cost
  a larger size shows better) every link is then timed near the largest bucket (capped at
  ``MAX_PROBE_BYTES``); on a slower link at the mid size, which shows the per-byte cost already
  where a bucket-sized run would cost seconds (3.5 MB at 100 Mbit/s: 0.5 s a run). Each stage's
  runs are first submitted together, untimed (Horovod negotiates each new name once, in one
  round; the timed runs then take the cached path, as training steps do), then run one at a
  time in ``reps`` interleaved rounds, keeping each one's fastest;
- codecs: each candidate's whole per-rank work on one bucket (encode with the residual, the
  owner's decode-sum and re-encode, the final decode) by the real reducer on a loop-back comm
  (no wire), at two bucket sizes; fp16's casts likewise;
- agreement: every rank's times are allgathered and the fastest kept per entry (over the timed
  runs and over the ranks), so every rank fits the same lines and :func:`hvdp.reduce.auto.decide`
  takes the same decision. The fastest, because on a shared machine noise only adds time
  (a descheduled process, a rank that came early to a collective and measured its wait for the
  others); a rank that is slower for good (another device) shows in the trial of the first
  steps (``hvdp.reduce.chooser``), which times real steps at the slowest rank's pace.

Its wall time is kept in the table (``probe_s``) and shown by ``compression_stats()``.
"""
from __future__ import annotations

import struct
import time
from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple

from .auto import CostTable, Line
from .collectives import AVERAGE
from .twophase import chunk_length

MAX_PROBE_BYTES = 8 * 2**20       # larger buckets: the per-byte cost is extrapolated
MID_PROBE_BYTES = 2**20           # the second size (a slow link's largest)
CHEAP_S = 0.025                   # float32's second size faster: a fast link, bucket-sized runs
MAX_PROBE_ELEMENTS = 2**20        # codec work: per-element cost beyond is extrapolated
SMALL_BYTES = 4096


class LoopbackComm:
    """P-worker collectives without a wire: what this rank sends is what it receives. Lets the
    real reducer run its codec work alone, for timing."""

    def __init__(self, size: int, rank: int, ops):
        self.size, self.rank, self.ops = size, rank, ops

    def allreduce_async(self, x, name, op, prescale=1.0, postscale=1.0):
        return x

    def alltoall_async(self, buf, name):
        return buf

    def allgather_async(self, buf, name):
        return self.ops.cat([buf] * self.size)

    def wait(self, handle):
        return handle


def _two_sizes(big: int, small: int, unit: int) -> Tuple[int, int]:
    """Two distinct sizes, multiples of ``unit``: ~small and ~big (at least 4x apart)."""
    round_up = lambda x: max(unit, -(-int(x) // unit) * unit)  # noqa: E731
    hi = round_up(max(big, 4 * small))
    return round_up(min(small, hi // 4)), hi


def _fastest(runs: Sequence[Callable[[], None]], reps: int, clock) -> List[float]:
    """The fastest of ``reps`` timed runs of each, the runs interleaved (noise spreads evenly)."""
    best = [float("inf")] * len(runs)
    for _ in range(reps):
        for i, run in enumerate(runs):
            t0 = clock()
            run()
            best[i] = min(best[i], clock() - t0)
    return best


def measure(comm, ops, like, bucket_elements: Sequence[int], candidates: Sequence,
            make_reducer: Callable, gather: Callable[[bytes, str], List[bytes]],
            reps: int = 2, clock=time.perf_counter, sync: Callable[[], None] = lambda: None) -> CostTable:
    """Probe links and codecs for buckets of ``bucket_elements`` and return the shared table.

    Args:
        comm: the optimizer's collectives (``hvdp.reduce.collectives.Collectives``), P = ``comm.size``.
        ops: the adapter's array ops; ``like``: an array on the gradients' device.
        candidates: codec objects (as ``str(codec)`` keys the compute lines).
        make_reducer: ``(codec, comm) -> reducer`` exactly as training builds them.
        gather: ``(bytes, name) -> [every rank's bytes]`` (equal lengths), e.g. the adapter's
            ``allgather_fixed``.
        reps: timed runs of each collective (the fastest is kept), after one untimed run; codecs
            (local, cheaper) get one more.
        sync: waits for the device (CUDA: ``torch.cuda.synchronize``), called inside timings.
    """
    t_start = clock()
    nmax = max(list(bucket_elements) + [1])
    links = _link_runs(comm, ops, like, nmax, candidates)
    # the float32 allreduce at the small and the mid size first: its mid run says whether the
    # link is fast (decided from the agreed times, the fastest rank's: every rank runs the same
    # collectives next)
    first = [r for r in links if r.key == "allreduce.float32" and r.role != "big"]
    times = _time_links(comm, [r.submit for r in first], reps, clock, sync)
    fast = _agreed(times, gather, "hvdp.probe.mid")[-1] < CHEAP_S
    largest = {r.key: r.role for r in links}  # "big" where there is one, else "mid"
    wanted = largest if fast else {k: "mid" for k in largest}
    later = [r for r in links if r not in first and r.role in ("small", wanted[r.key])]
    times += _time_links(comm, [r.submit for r in later], reps, clock, sync)
    entries = [("link", r.key, r.x) for r in first + later]
    # codecs, alone on this rank
    runs = _codec_runs(LoopbackComm(comm.size, comm.rank, ops), ops, like, nmax, candidates, make_reducer,
                       entries, sync)
    for run in runs:  # untimed: first use (allocations, a kernel's set-up)
        run()
    times += _fastest(runs, reps + 1, clock)
    return _agreed_table(comm.size, entries, times, clock() - t_start, gather)


class _LinkRun(NamedTuple):
    key: str                          # "allreduce.float32", ...
    x: float                          # bytes, as the table's line counts them
    role: str                         # "small", "mid" or "big" (in this order per key)
    submit: Callable[[], object]


def _sizes(big: int, mid_cap: int, small: int, unit: int) -> List[Tuple[str, int]]:
    """(role, size), multiples of ``unit``: small, mid (at most ~``mid_cap``), and big where it
    is larger than mid."""
    lo, hi = _two_sizes(big, small, unit)
    _, mid = _two_sizes(min(hi, mid_cap), small, unit)
    return [("small", lo), ("mid", mid)] + ([("big", hi)] if hi > mid else [])


def _link_runs(comm, ops, like, nmax: int, candidates) -> List[_LinkRun]:
    """The collectives to time, in the same order on every rank."""
    p = comm.size
    runs: List[_LinkRun] = []

    def link(key: str, x: float, role: str, submit: Callable[[], object]) -> None:
        runs.append(_LinkRun(key, x, role, submit))

    for dtype, item in (("float32", 4), ("float16", 2)):
        for role, nb in _sizes(min(item * nmax, MAX_PROBE_BYTES), MID_PROBE_BYTES, SMALL_BYTES, 4 * p):
            buf = ops.zeros(nb // item, dtype, like=like)
            link(f"allreduce.{dtype}", nb, role, lambda b=buf, n=f"hvdp.probe.ar.{dtype}.{nb}":
                 comm.allreduce_async(b, n, AVERAGE, 1.0, 1.0))
    two_phase = [c for c in candidates if not c.summable]
    payload = max([c.payload_nbytes(chunk_length(nmax, p, c.align)) for c in two_phase] + [4 * nmax // p])
    for role, nb in _sizes(min(payload, MAX_PROBE_BYTES // p), MID_PROBE_BYTES // p, SMALL_BYTES // p, 8):
        send, own = ops.zeros(p * nb, "uint8", like=like), ops.zeros(nb, "uint8", like=like)
        link("alltoall", p * nb, role, lambda b=send, n=f"hvdp.probe.a2a.{nb}": comm.alltoall_async(b, n))
        link("allgather", nb, role, lambda b=own, n=f"hvdp.probe.ag.{nb}": comm.allgather_async(b, n))
    return runs


def _time_links(comm, submits: Sequence[Callable], reps: int, clock, sync) -> List[float]:
    """Untimed, all at once (one negotiation round for every new name), then one by one."""
    for h in [s() for s in submits]:
        comm.wait(h)
    return _fastest([lambda s=s: (comm.wait(s()), sync()) for s in submits], reps, clock)


def _rows(values: Sequence[float], gather, name: str) -> List[Tuple[float, ...]]:
    """Every rank's ``values``, allgathered."""
    return [struct.unpack(f"<{len(values)}d", b) for b in gather(struct.pack(f"<{len(values)}d", *values), name)]


def _agreed(times: Sequence[float], gather, name: str) -> List[float]:
    """The fastest rank's time per entry: the same list on every rank."""
    rows = _rows(times, gather, name)
    return [min(r[i] for r in rows) for i in range(len(times))]


def _codec_runs(loop, ops, like, nmax: int, candidates, make_reducer, entries, sync) -> List[Callable]:
    """Each codec's whole reduction on the loop-back comm (``entries`` gets their keys)."""
    runs = []
    for n in _two_sizes(min(nmax, MAX_PROBE_ELEMENTS), 4096, 1):
        x = ops.zeros(n, "float32", like=like) + 1.0
        for c in candidates:
            if c.name == "none":
                continue
            if c.summable:
                fn = lambda c=c, x=x: ops.cast(ops.cast(x, c.wire_dtype), "float32")  # noqa: E731
            else:
                red = make_reducer(c, loop)
                fn = lambda red=red, x=x: red.finish(red.start("hvdp.probe", x))  # noqa: E731
            entries.append(("codec", str(c), n))
            runs.append(lambda fn=fn: (fn(), sync()))
    return runs


def _agreed_table(p: int, entries, times: List[float], wall: float, gather) -> CostTable:
    """The same table everywhere (see the module's docstring for min / max)."""
    rows = _rows(list(times) + [wall], gather, "hvdp.probe.table")
    agreed = [min(r[i] for r in rows) for i in range(len(times))] + [max(r[-1] for r in rows)]
    points: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
    for (kind, key, x), t in zip(entries, agreed):
        points.setdefault((kind, key), []).append((x, t))
    links = {k: Line.fit(v) for (kind, k), v in points.items() if kind == "link"}
    compute = {k: Line.fit(v) for (kind, k), v in points.items() if kind == "codec"}
    return CostTable(p, links, compute, probe_s=agreed[-1])
