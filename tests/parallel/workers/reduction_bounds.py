"""Shared by the torch and Keras checks: is a reduced gradient within its codec's bound?

Framework-free (numpy). ``per_rank[r][i]``: rank r's local gradient of tensor i (flat);
``got[i]``: this rank's reduced gradient of tensor i (flat); ``buckets``: the optimizer's plan.
"""
import numpy as np

from hvdp import codecs
from hvdp.ops import NumpyOps
from hvdp.reduce.simcomm import FakeGroup
from hvdp.reduce.twophase import TwoPhaseReducer

# one rounding of each input and one of the reduced value
REL = {"fp16": 2 ** -11, "bf16": 2 ** -8}
QMAX = {"int8": 127, "int4": 7}  # blockwise codecs: a step is the block's largest |value| / QMAX


def reference_two_phase(codec, flats):
    """The numpy reference of the whole two-phase reduction (first step: no residual yet)."""
    group = FakeGroup(len(flats))
    reds = [TwoPhaseReducer(codec, NumpyOps(), c, False) for c in group.comms]
    pend = [r.start("b", f) for r, f in zip(reds, flats)]
    for r, p in zip(reds, pend):
        r.exchange(p)
    return reds[0].finish(pend[0])


def check_reduced(codec, per_rank, got, buckets, rtol_ref=1e-6, reference=None, flips=0.0):
    """Assert the bounds; return the largest |error| against the exact float64 average.
    ``reference(codec, flats)``: the pipeline to replay (default: the flat two-phase one).
    ``flips``: the fraction of a blockwise codec's elements that may differ from the replay by
    up to one code step of the largest block (in a traced TF graph the scales came out one ulp
    off the reference's, as if Grappler had turned ``x / c`` into ``x * (1/c)``; a quotient on
    or next to a rounding tie then rounds the other way); the codec's bound still holds for all."""
    codec = codecs.get(codec)
    p = len(per_rank)
    exact = [np.mean([np.asarray(per_rank[r][i], np.float64) for r in range(p)], axis=0)
             for i in range(len(got))]
    err = [np.abs(np.asarray(g, np.float64) - e) for g, e in zip(got, exact)]
    gmax = max(float(np.abs(per_rank[r][i]).max()) for r in range(p) for i in range(len(got))
               if np.size(per_rank[r][i]))
    emax = max(float(np.abs(e).max()) for e in exact if e.size)
    if codec.name in REL:  # each worker's value and the sum rounded once: relative to magnitudes
        bound = 3 * REL[codec.name] * gmax
        assert all(float(e.max()) <= bound for e in err if e.size), (codec.name, bound)
    if codec.name in QMAX:
        # half a step of each worker's block (step <= largest |g| / QMAX) plus half a step of the
        # re-encoded reduced block; blocks span tensors of a bucket, so global maxima bound all
        h = 2 * QMAX[codec.name]
        bound = gmax / h + (emax + gmax / h) / h
        assert all(float(e.max()) <= bound * 1.001 for e in err if e.size), (codec.name, bound)
    if not codec.summable:  # the exact pipeline, replayed in numpy on every rank's buckets
        for idx in buckets:
            flats = [np.concatenate([np.asarray(per_rank[r][i], np.float32) for i in idx]) for r in range(p)]
            ref = (reference or reference_two_phase)(codec, flats)
            mine = np.concatenate([np.asarray(got[i], np.float32) for i in idx])
            top = float(np.abs(ref).max())
            if flips and codec.name in QMAX:
                off = ~np.isclose(mine, ref, rtol=rtol_ref, atol=rtol_ref * top)
                assert off.mean() <= flips, (codec.name, int(off.sum()), off.size)
                step = top / QMAX[codec.name] * 1.001
                assert np.all(np.abs(mine - ref)[off] <= step), (codec.name, float(np.abs(mine - ref).max()), step)
                continue
            np.testing.assert_allclose(mine, ref, rtol=rtol_ref, atol=rtol_ref * top, err_msg=codec.name)
    return max(float(e.max()) for e in err if e.size)


def reference_two_level(codec, flats, local_of, cross_of):
    """The numpy reference of the two-level reduction (``hvdp.reduce.hierarchy``), first step:
    ``local_of[r]`` / ``cross_of[r]``: (group index, index in it) of rank r."""
    import threading

    from hvdp.reduce.hierarchy import HierarchicalReducer
    p = len(flats)
    n_local = max(g for g, _ in local_of) + 1
    n_cross = max(g for g, _ in cross_of) + 1
    locals_ = [FakeGroup(p // n_local, blocking=True) for _ in range(n_local)]
    crosses = [FakeGroup(p // n_cross, blocking=True) for _ in range(n_cross)]
    reds = [HierarchicalReducer(codec, NumpyOps(), locals_[local_of[r][0]].comms[local_of[r][1]],
                                crosses[cross_of[r][0]].comms[cross_of[r][1]], False) for r in range(p)]
    out = [None] * p

    def one(r):
        pend = reds[r].start("b", flats[r])
        reds[r].exchange(pend)
        out[r] = reds[r].finish(pend)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out[0]


def reference_powersgd(codec, shapes, flats, q0):
    """powersgd's first step written out in float64 numpy (no residual yet): ``flats[r]`` is
    rank r's flat bucket of tensors of ``shapes``, ``q0`` the initial Q of each compressed one.
    -> the averaged bucket: P = orth(sum M Q), M ~ P (sum M^T P / size)^T; the rest averaged."""
    p, out, off, j = len(flats), [], 0, 0
    for s in shapes:
        k = int(np.prod(s))
        xs = [np.asarray(f[off:off + k], np.float64) for f in flats]
        mat = codec.matrix(tuple(s))
        if mat is None:
            out.append(sum(xs) / p)
        else:
            n, m, _ = mat
            ms = [x.reshape(n, m) for x in xs]
            q = np.linalg.qr(np.asarray(q0[j], np.float64))[0]
            big_p = np.linalg.qr(sum(mi @ q for mi in ms))[0]
            out.append((big_p @ (sum(mi.T @ big_p for mi in ms) / p).T).ravel())
            j += 1
        off += k
    return np.concatenate(out)
