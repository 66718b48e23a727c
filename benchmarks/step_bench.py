"""Step time of hvdp vs raw Horovod vs torch DDP, side by side in the same processes.

Run under horovodrun (np 1 or 2). Contenders take turns, one iteration of ``--batches`` batches
each, ``--iters`` times, so machine noise hits all of them alike. Rank 0 writes JSON.
"""
import argparse
import copy
import json
import os
import sys

import torch

import horovod.torch as raw_hvd
import hvdp.torch as hvd
from hvdp import config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mean_ci, ratio_ci, time_batches  # noqa: E402


def build_model(width, depth):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--codecs", help="instead: hvdp with each of these codecs, e.g. none,fp16,int8,auto")
    ap.add_argument("--json-out", required=True)
    a = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = build_model(a.width, a.depth)
    x = torch.randn(a.batch, a.width)
    y = torch.randint(0, 10, (a.batch,))

    def make_step(model, opt):
        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return step

    contenders, opts = {}, {}
    if a.codecs:
        for c in a.codecs.split(","):  # "int8+compiled": the codec fused by torch.compile
            m = copy.deepcopy(base)
            name = c.split("+")[0]
            opts[c] = hvd.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=[
                    (f"{c}.{k}", p) for k, p in m.named_parameters()], compression=name,
                compile_codecs=c.endswith("+compiled"))
            contenders[c] = make_step(m, opts[c])
        return run(a, contenders, base, opts)
    m1 = copy.deepcopy(base)
    contenders["horovod"] = make_step(m1, raw_hvd.DistributedOptimizer(
        torch.optim.SGD(m1.parameters(), lr=0.01), named_parameters=m1.named_parameters()))
    m2 = copy.deepcopy(base)
    contenders["hvdp"] = make_step(m2, hvd.DistributedOptimizer(
        torch.optim.SGD(m2.parameters(), lr=0.01), named_parameters=m2.named_parameters()))
    if a.ddp and hvd.size() > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config.ddp_port(29555)}",
                                rank=hvd.rank(), world_size=hvd.size())
        m3 = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        contenders["ddp"] = make_step(m3, torch.optim.SGD(m3.parameters(), lr=0.01))
    return run(a, contenders, base)


def run(a, contenders, base, opts=None):
    for step in contenders.values():
        for _ in range(a.warmup):
            step()
    times = {k: [] for k in contenders}
    for _ in range(a.iters):
        for k, step in contenders.items():
            hvd.allreduce(torch.zeros(1), name="bench.barrier")  # start together
            times[k].append(time_batches(step, a.batches))
    # the slowest rank sets the pace of a data-parallel step
    worst = {k: [hvd.allreduce(torch.tensor(t), op=hvd.Max if hasattr(hvd, "Max") else hvd.Sum,
                               name=f"bench.max.{k}.{i}").item() for i, t in enumerate(v)]
             for k, v in times.items()}
    if hvd.rank() == 0:
        out = {"size": hvd.size(), "batch": a.batch,
               "params": sum(p.numel() for p in base.parameters()),
               "step_s": {k: mean_ci(v) for k, v in worst.items()},
               "samples_per_s": {k: mean_ci([hvd.size() * a.batch / t for t in v]) for k, v in worst.items()}}
        if "hvdp" in worst:
            out["ratio_hvdp_over_horovod"] = ratio_ci(worst["hvdp"], worst["horovod"])
        if "none" in worst:
            out["ratio_over_none"] = {k: ratio_ci(v, worst["none"]) for k, v in worst.items()}
        if "ddp" in worst:
            out["ratio_hvdp_over_ddp"] = ratio_ci(worst["hvdp"], worst["ddp"])
        # auto: its choice per bucket, the costs behind it, and what its probe cost (it ran in
        # the warm-up steps, outside the timed ones)
        out["auto"] = {k: o.compression_stats()["auto"] for k, o in (opts or {}).items()
                       if "auto" in o.compression_stats()}
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
