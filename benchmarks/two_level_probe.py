"""The probe job of ``benchmarks/project_scale.py``, on the two-node cluster: the cost lines
(``hvdp.reduce.auto``'s A + B·x model, measured by ``hvdp.reduce.probe``) of the whole job's collectives, of
the node-local ones and of the cross-node ones, each codec's work, and a step's compute alone.

    horovodrun -np 4 -H hvdpnodea:2,hvdpnodeb:2 ... python two_level_probe.py --json-out F
"""
import argparse
import json
import statistics
import time

import torch

import hvdp.torch as hvd
from hvdp import codecs
from hvdp.reduce.probe import measure
from hvdp.torch.agreement import allgather_fixed
from hvdp.torch.comm import TorchCollectives
from hvdp.torch.mesh import levels
from hvdp.torch.ops import TorchOps
from hvdp.reduce.twophase import TwoPhaseReducer

from two_level_bench import build

CANDIDATES = ("none", "bf16", "int8")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json-out", required=True)
    a = ap.parse_args()
    hvd.init(process_sets="dynamic")
    ops = TorchOps()
    model = build(a.width, a.depth)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(), compression="int8")
    buckets = list(opt.engine.bucket_sizes().values())
    # a step's compute alone: forward, backward, the update (no reduction)
    local_model = build(a.width, a.depth)
    local_opt = torch.optim.SGD(local_model.parameters(), lr=1e-3)
    x = torch.randn(a.batch, a.width)
    times = []
    for i in range(12):
        t0 = time.perf_counter()
        local_opt.zero_grad()
        local_model(x).pow(2).mean().backward()
        local_opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    compute = max(hvd.allgather(torch.tensor([statistics.median(times)], dtype=torch.float64),
                                name="compute").tolist())
    world = TorchCollectives(hvd.global_process_set, scope="probe.world.")
    local, cross = levels(hvd.global_process_set, 900)
    like = torch.zeros(1)
    cands = [codecs.get(c) for c in CANDIDATES]
    tables = {}
    for name, comm, sizes in (("world", world, buckets),
                              ("local", local, buckets),
                              ("cross", cross, [-(-n // local.size) for n in buckets])):
        t = measure(comm, ops, like, sizes, cands,
                    lambda c, cm: TwoPhaseReducer(c, ops, cm, c.error_feedback_default), allgather_fixed(),
                    reps=3)
        tables[name] = t.as_dict()
    if hvd.rank() == 0:
        with open(a.json_out, "w") as f:
            json.dump({"buckets": buckets, "plain": sum(p.numel() for p in model.parameters()) - sum(buckets),
                       "compute_s": compute, "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
                       "tables": tables}, f, indent=1)


if __name__ == "__main__":
    main()
