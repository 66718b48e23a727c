"""Codec speed and wire bytes, measured side by side in one run (ratios, not absolute times).

    python benchmarks/codecs_bench.py [--mib 64] [--json-out F]

Speed: compress+decompress throughput of float32 input (torch ops, this machine's CPU), as a ratio
to a memcpy of the same buffer measured in the same run. Method of Horovod's synthetic
benchmarks: warm-up, then 10 iterations of 10 repetitions; mean and 95% interval of the mean.
Wire bytes: what the two-phase reduction hands to alltoall/allgather for P simulated workers
(hvdp.simcomm), per worker, against a float32 ring allreduce, next to the formula.
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch

from hvdp import codecs
from hvdp.collectives import AVERAGE
from hvdp.ops import NumpyOps
from hvdp.simcomm import FakeGroup
from hvdp.stats import WireStats
from hvdp.twophase import TwoPhaseReducer
from hvdp.torch import TorchOps
from hvdp.torch.compiled import CompiledCodec

T95 = 2.262  # Student t, 9 degrees of freedom


def timed(fn, reps=10, iters=10, warmup=3):  # warm-up also absorbs torch.compile
    for _ in range(warmup):
        fn()
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
    return rows


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
    sp = speed(a.mib)
    print(f"codec speed, {a.mib} MiB float32, 1 thread (GB/s of float32 input, ± 95% interval)")
    print("| codec | compress+decompress GB/s | ÷ memcpy |\n|---|---|---|")
    for k, (g, ci, ratio) in sp.items():
        print(f"| {k} | {g:.2f} ± {ci:.2f} | {ratio:.3f} |")
    wi = wire()
    print("\nwire bytes per worker ÷ float32 ring allreduce (measured from the buffers handed to the "
          "collectives | formula b/4)")
    print("| codec | P=2 | P=4 | P=8 |\n|---|---|---|---|")
    for name in ["fp16", "bf16", "int8", "topk"]:
        cells = " | ".join(f"{wi[(name, p)][0]:.4f} ({wi[(name, p)][1]:.4f})" for p in (2, 4, 8))
        print(f"| {name} | {cells} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"speed": sp, "wire": {f"{k[0]}@{k[1]}": v for k, v in wi.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
