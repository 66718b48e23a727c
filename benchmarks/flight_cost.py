"""What the flight record (hvdp/cluster/flight.py) costs: per collective, and per training step.

Run under horovodrun (np 2)::

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/flight_cost.py --json-out r.json

1. Per collective, in-process: ``Recorded`` (hvdp/reduce/recorded.py) around a collectives object
   that does nothing, against the bare object: what recording adds to one submit + wait
   (the ring's append, two clock reads, the per-name counters, the byte count), recording on
   and off (``HVDP_FLIGHT_RECORDS=0``).
2. Per step: the examples' model (examples/torch_digits.py) trained by hvdp.torch with each
   codec, recording on and off in turns, one step each (so the machine's noise hits both): the
   median step time, the collectives recorded per step, and the cost as a fraction of a step
   (collectives per step x the cost per collective / step time, and the measured A/B ratio).
Rank 0 prints the figures and writes them as JSON.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

import hvdp.torch as hvd
from hvdp.cluster.flight import RECORDER
from hvdp.ops import NumpyOps
from hvdp.reduce.recorded import Recorded

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from common import ratio_ci  # noqa: E402
from torch_digits import make_model  # noqa: E402


class NullComm:
    size, rank, scope = 2, 0, "hvdp.opt0."

    def allreduce_async(self, x, name, op, prescale=1.0, postscale=1.0):
        return x

    def alltoall_async(self, buf, name):
        return buf

    def allgather_async(self, buf, name):
        return buf

    def wait(self, handle):
        return handle


def recording(on: bool) -> None:
    RECORDER._capacity, RECORDER._ring = (1024 if on else 0), None


def per_collective(n: int = 200_000, reps: int = 5) -> dict:
    """Seconds added to one submit + wait by the recording wrapper, on and off (best of reps)."""
    bare = NullComm()
    wrapped = Recorded(bare, NumpyOps(), codec=lambda: "int8", step=lambda: 0)
    buf = np.zeros(1024, np.uint8)
    names = [f"hvdp.a2a.b{i}" for i in range(8)]

    def loop(comm):
        t0 = time.perf_counter()
        for i in range(n):
            comm.wait(comm.alltoall_async(buf, names[i & 7]))
        return (time.perf_counter() - t0) / n
    out = {}
    for label, comm, on in (("bare", bare, True), ("recording_on", wrapped, True), ("recording_off", wrapped, False)):
        recording(on)
        out[label] = min(loop(comm) for _ in range(reps))
    recording(True)
    return {"bare_s": out["bare"], "added_on_s": out["recording_on"] - out["bare"],
            "added_off_s": out["recording_off"] - out["bare"]}


def per_step(codec: str, blocks: int, steps: int, batch: int) -> dict:
    torch.manual_seed(0)
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=codec)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))

    def run(k):
        t0 = time.perf_counter()
        for _ in range(k):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - t0) / k
    run(20)  # warm-up (and past the policy's warm-up, so the codec runs)
    seq0 = RECORDER._seq
    recording(True)
    run(steps)
    per = (RECORDER._seq - seq0) / steps
    on, off = [], []
    for i in range(2 * blocks * steps):  # one step each, in turns (on off off on ...): bursts of
        flag = (i % 2 == 0) != ((i // 2) % 2 == 1)  # the machine's load hit both alike
        recording(flag)
        (on if flag else off).append(run(1))
    recording(True)
    ratio, ci = ratio_ci(on, off)
    return {"codec": codec, "collectives_per_step": per, "step_s_on": statistics.median(on),
            "step_s_off": statistics.median(off), "median_on_over_off": statistics.median(on) / statistics.median(off),
            "on_over_off": ratio, "on_over_off_ci95": ci}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codecs", default="none,int8")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    coll = per_collective()
    rows = [per_step(c, a.blocks, a.steps, a.batch) for c in a.codecs.split(",")]
    for r in rows:
        r["cost_fraction_of_step"] = r["collectives_per_step"] * coll["added_on_s"] / r["step_s_off"]
    if hvd.rank() == 0:
        print(f"per collective: bare submit+wait {coll['bare_s'] * 1e6:.2f} us; recording adds "
              f"{coll['added_on_s'] * 1e6:.2f} us (on), {coll['added_off_s'] * 1e6:.2f} us (off)")
        for r in rows:
            print(f"{r['codec']}: {r['collectives_per_step']:.1f} collectives/step, step "
                  f"{r['step_s_off'] * 1e3:.2f} ms (off) vs {r['step_s_on'] * 1e3:.2f} ms (on), medians: "
                  f"on/off {r['median_on_over_off']:.4f} (of pairs: {r['on_over_off']:.3f} +- "
                  f"{r['on_over_off_ci95']:.3f}); recording = "
                  f"{100 * r['cost_fraction_of_step']:.3f}% of a step")
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump({"per_collective": coll, "steps": rows, "size": hvd.size(),
                           "model": "examples/torch_digits.py make_model (64-256-256-10)",
                           "batch_per_rank": a.batch}, f, indent=1)


if __name__ == "__main__":
    main()
