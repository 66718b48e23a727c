"""Codec speed and wire bytes, measured side by side in one run (ratios, not absolute times).

    python benchmarks/codecs_bench.py [--mib 64] [--json-out F]

Speed: compress+decompress throughput of float32 input (torch ops, this machine's CPU), as a ratio
to a memcpy of the same buffer measured in the same run. Then the fused CPU kernels (hvdp.kernels)
against the array-op path, side by side (numpy and torch CPU arrays): int8 encode+decode, int8 +
error feedback (encode with the residual, then decode; and the reducer's whole worker + owner
work at P = 1), the owner's decode-sum of P = 2 and 4 payloads, bf16 encode+decode. Each of these
takes turns with a memcpy, iteration by iteration: the median of the paired ratios and the ratio
of the best iterations (what a quiet machine gives) are reported. Method of Horovod's synthetic
benchmarks: warm-up, then 10 iterations of 10 repetitions; mean and 95% interval of the mean.
Wire bytes: what the two-phase reduction hands to alltoall/allgather for P simulated workers
(hvdp.reduce.simcomm), per worker, against a float32 ring allreduce, next to the formula.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from hvdp import codecs
from hvdp.reduce.collectives import AVERAGE
from hvdp.kernels import registry
from hvdp.ops import NumpyOps
from hvdp.reduce.simcomm import FakeGroup
from hvdp.reduce.stats import WireStats
from hvdp.reduce.twophase import TwoPhaseReducer
from hvdp.torch import TorchOps
from hvdp.torch.compiled import CompiledCodec

T95 = 2.262  # Student t, 9 degrees of freedom


def timed(fn, reps=10, iters=10, warmup=3):  # warm-up also absorbs torch.compile
    for _ in range(warmup):
        fn()
    if reps is None:  # as many as fill ~50 ms per iteration (slow paths take fewer)
        t0 = time.perf_counter()
        fn()
        reps = max(1, min(10, int(0.05 / max(time.perf_counter() - t0, 1e-6))))
    rates = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        rates.append(reps / (time.perf_counter() - t0))
    mean = statistics.mean(rates)
    return mean, T95 * statistics.stdev(rates) / len(rates) ** 0.5


class _One:
    """A world of one: the reducer's collectives are skipped (P = 1), its codec work is not."""
    size, rank = 1, 0


def speed(mib):
    os.environ["HVDP_KERNELS"] = "off"  # these rows are the array-op path (and torch.compile's)
    n = mib * 2**20 // 4
    x = torch.randn(n)
    dst = torch.empty_like(x)
    ops = TorchOps()
    rows = {}
    base, base_ci = timed(lambda: dst.copy_(x))
    gbs = lambda r: r * 4 * n / 1e9  # noqa: E731
    rows["memcpy"] = (gbs(base), gbs(base_ci), 1.0)
    for label, name, ef in [("fp16", "fp16", False), ("bf16", "bf16", False),
                            ("int8", "int8", False), ("int8+EF", "int8", True),
                            ("int8 compiled", "int8", False), ("int8+EF compiled", "int8", True),
                            ("topk 1%+EF", "topk", True)]:
        codec = codecs.get(name)
        if "compiled" in label:
            codec = CompiledCodec(codec)
        if ef:
            red = TwoPhaseReducer(codec, ops, _One(), True, AVERAGE)
            fn = lambda red=red: red.finish(red.start("b", x))  # noqa: E731
        else:
            fn = lambda codec=codec: codec.decode(ops, codec.encode(ops, x), n)  # noqa: E731
        r, ci = timed(fn)
        rows[label] = (gbs(r), gbs(ci), r / base)
    os.environ.pop("HVDP_KERNELS", None)
    krows, kdesc = _kernel_rows(n, gbs)
    return rows, krows, kdesc


def _reps(fn, seconds=0.05):
    t0 = time.perf_counter()
    fn()
    return max(1, min(200, int(seconds / max(time.perf_counter() - t0, 1e-6))))


def paired(fn, base_fn, iters=10, warmup=2):
    """(rate of fn, its 95% interval, median ratio to base_fn, the ratios' 95% interval of the
    mean, ratio of the best rates): fn and the memcpy take turns, iteration by iteration, so a
    machine whose load drifts during the run shifts both sides of each ratio alike; the median
    and the best-of ratio resist an iteration that another process pre-empted."""
    for _ in range(warmup):
        fn(), base_fn()
    rf, rb = _reps(fn), _reps(base_fn)
    rates, base_rates, ratios = [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(rb):
            base_fn()
        t1 = time.perf_counter()
        for _ in range(rf):
            fn()
        t2 = time.perf_counter()
        rates.append(rf / (t2 - t1))
        base_rates.append(rb / (t1 - t0))
        ratios.append(rates[-1] / base_rates[-1])
    ci = lambda v: T95 * statistics.stdev(v) / len(v) ** 0.5  # noqa: E731
    best = max(rates) / max(base_rates)
    return statistics.median(rates), ci(rates), statistics.median(ratios), ci(ratios), best


def _kernel_rows(n, gbs):
    """Each phase through the fused kernels and through the array ops, on numpy and torch arrays,
    each rated against a memcpy of the same n float32 values taking turns with it."""
    rows = {}
    int8, bf16 = codecs.get("int8"), codecs.get("bf16")
    for fw, ops, mk in [("numpy", NumpyOps(), lambda a: a), ("torch", TorchOps(), torch.from_numpy)]:
        x = mk(np.random.default_rng(0).standard_normal(n).astype(np.float32))
        dst = mk(np.empty(n, np.float32))
        memcpy = (lambda: dst.copy_(x)) if fw == "torch" else (lambda: np.copyto(dst, x))
        r = mk(np.random.default_rng(1).standard_normal(n).astype(np.float32) * np.float32(1e-3))
        res, dec = mk(np.empty(n, np.float32)), mk(np.empty(n, np.float32))
        ki, kb = registry.select(int8, ops, x), registry.select(bf16, ops, x)
        if ki is None or kb is None:
            print(f"no kernels for {fw}: {registry.explain(int8, ops, x)[1]}")
            continue
        pl_i = mk(np.empty(int8.payload_nbytes(n), np.uint8))
        pl_b = mk(np.empty(bf16.payload_nbytes(n), np.uint8))

        def ops_ef(x=x, r=r, ops=ops):  # the reducer's array ops for one chunk with its residual
            y = x + r
            q = int8.encode(ops, y)
            d = int8.decode(ops, q, n)
            return ops.where(ops.isfinite(y - d), y - d, 0.0)

        cases = {
            "int8 encode+decode": (lambda: ki.decode(ki.encode(x, out=pl_i), n, out=dec),
                                   lambda: int8.decode(ops, int8.encode(ops, x), n)),
            "int8+EF encode (residual)+decode": (
                lambda: ki.decode(ki.encode(x, prev=r, residual=res, out=pl_i), n, out=dec), ops_ef),
            "bf16 encode+decode": (lambda: kb.decode(kb.encode(x, out=pl_b), n, out=dec),
                                   lambda: bf16.decode(ops, bf16.encode(ops, x), n)),
        }
        for p in (2, 4):  # P payloads of n values each -> n sums (as benchmarks/cuda_codecs.py)
            pls = ops.cat([int8.encode(ops, x * float(j + 1)) for j in range(p)])
            nb = int8.payload_nbytes(n)

            def ops_sum(pls=pls, p=p, nb=nb, ops=ops):
                acc = int8.decode(ops, pls[:nb], n)
                for j in range(1, p):
                    acc = ops.add_(acc, int8.decode(ops, pls[j * nb:(j + 1) * nb], n))
                return ops.mul_(acc, 1.0 / p)
            cases[f"owner decode-sum p={p}"] = (lambda pls=pls, p=p: ki.decode_sum(pls, p, n, 1.0 / p), ops_sum)
        for path, env in (("kernel", "auto"), ("array ops", "off")):  # the reducer, worker + owner
            os.environ["HVDP_KERNELS"] = env
            red = TwoPhaseReducer(int8, ops, _One(), True, AVERAGE)
            red.finish(red.start("b", x))  # selects the path while the setting holds
            cases.setdefault("int8+EF reducer (worker+owner, P=1)", [None, None])[env == "off"] = \
                lambda red=red: red.finish(red.start("b", x))
        os.environ.pop("HVDP_KERNELS", None)
        for label, (kern, arr) in cases.items():
            for path, fn in (("kernel", kern), ("array ops", arr)):
                rate, ci, ratio, ratio_ci, best = paired(fn, memcpy)
                rows.setdefault(label, {})[f"{path} ({fw})"] = (gbs(rate), gbs(ci), ratio, ratio_ci, best)
    return rows, getattr(registry.select(int8, NumpyOps(), np.zeros(4, np.float32)), "description", None)


def wire(ps=(2, 4, 8), n=2**20):
    out = {}
    for name in ["fp16", "bf16", "int8", "topk"]:
        codec = codecs.get(name)
        for p in ps:
            stats = WireStats()
            group = FakeGroup(p)
            reds = [TwoPhaseReducer(codec, NumpyOps(), c, False, stats=stats) for c in group.comms]
            x = np.ones(n, np.float32)
            pend = [r.start("b", x) for r in reds]
            for r, pe in zip(reds, pend):
                r.exchange(pe)
            for r, pe in zip(reds, pend):
                r.finish(pe)
            stats.end_step()
            measured = stats.summary()["last_step"][codec.name]["ratio"]
            c = n // p
            formula = codec.payload_nbytes(c) / (4 * c)
            out[(name, p)] = (measured, formula)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    sp, kr, kdesc = speed(a.mib)
    print(f"codec speed, {a.mib} MiB float32, 1 thread (GB/s of float32 input, ± 95% interval)")
    print("| codec | compress+decompress GB/s | ÷ memcpy |\n|---|---|---|")
    for k, (g, ci, ratio) in sp.items():
        print(f"| {k} | {g:.2f} ± {ci:.2f} | {ratio:.3f} |")
    print(f"\nfused CPU kernels ({kdesc}) vs array ops: throughput ÷ memcpy, each taking turns with "
          "a memcpy of the same buffer: median ratio ± 95% interval of the mean / ratio of the best "
          "iterations (median GB/s of float32 values)")
    cols = [f"{p} ({fw})" for p in ("kernel", "array ops") for fw in ("numpy", "torch")]
    print("| phase | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for k, row in kr.items():
        cells = [f"{row[c][2]:.3f} ± {row[c][3]:.3f} / {row[c][4]:.3f} ({row[c][0]:.2f})" if c in row else "—"
                 for c in cols]
        print(f"| {k} | " + " | ".join(cells) + " |")
    wi = wire()
    print("\nwire bytes per worker ÷ float32 ring allreduce (measured from the buffers handed to the "
          "collectives | formula b/4)")
    print("| codec | P=2 | P=4 | P=8 |\n|---|---|---|---|")
    for name in ["fp16", "bf16", "int8", "topk"]:
        cells = " | ".join(f"{wi[(name, p)][0]:.4f} ({wi[(name, p)][1]:.4f})" for p in (2, 4, 8))
        print(f"| {name} | {cells} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"speed": sp, "kernels": kr, "kernel_build": kdesc,
                       "wire": {f"{k[0]}@{k[1]}": v for k, v in wi.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
