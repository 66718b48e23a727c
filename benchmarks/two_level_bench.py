"""The job of ``benchmarks/two_level.py``: step time and inter-node bytes per step of each method,
on 4 ranks of a two-node cluster (2 per node), interleaved round by round so that drift and
noise fall on every method alike.

Each rank trains the same MLP (``--width`` x ``--depth`` Linear layers) on its own small batch;
a method's step is forward, backward, its reduction and an SGD update. Inter-node bytes: rank 0
reads its node's veth counters (``/proc/net/dev`` of its network namespace, tx + rx: every byte
that crosses the link, both ways) around each method's timed steps. Also written: each
method's codec work per step (``compression_stats()`` phase times) for the projection.

    horovodrun -np 4 -H hvdpnodea:2,hvdpnodeb:2 ... python two_level_bench.py --iface hvdp0 --json-out F
"""
import argparse
import json
import statistics
import time

import torch

import horovod.torch as raw
import hvdp.torch as hvd

# name -> (library, compression, hierarchical)
METHODS = {
    "horovod": ("horovod", None, False),
    "none": ("hvdp", "none", False),
    "none 2L": ("hvdp", "none", True),
    "bf16 2L": ("hvdp", "bf16", True),
    "int8": ("hvdp", "int8", False),
    "int8 2L": ("hvdp", "int8", True),
}


def veth(iface):
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                v = rest.split()
                return int(v[0]) + int(v[8])  # rx + tx
    raise SystemExit(f"no interface {iface} in this rank's network namespace")


def build(width, depth, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def make(method, width, depth):
    lib, comp, hier = METHODS[method]
    model = build(width, depth)
    base = torch.optim.SGD(model.parameters(), lr=1e-3)
    if lib == "horovod":
        opt = raw.DistributedOptimizer(base, named_parameters=model.named_parameters())
    else:
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=comp,
                                       hierarchical=hier)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iface", required=True)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per method per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json-out", required=True)
    a = ap.parse_args()
    hvd.init(process_sets="dynamic")
    r = hvd.rank()
    assert (hvd.size(), hvd.local_size(), hvd.cross_size()) == (4, 2, 2), (hvd.size(), hvd.local_size())
    names = a.methods.split(",")
    built = {m: make(m, a.width, a.depth) for m in names}
    x = torch.randn(a.batch, a.width, generator=torch.Generator().manual_seed(r))

    def step(m):
        model, opt = built[m]
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    for m in names:
        for _ in range(a.warmup):
            step(m)
    params = sum(p.numel() for p in built[names[0]][0].parameters())
    times = {m: [] for m in names}
    cross = {m: [] for m in names}
    compute = {m: [] for m in names}
    for _ in range(a.rounds):
        for m in names:
            hvd.barrier()
            b0, t0 = veth(a.iface), time.perf_counter()
            for _ in range(a.steps):
                step(m)
            hvd.barrier()
            t1, b1 = time.perf_counter(), veth(a.iface)
            times[m].append((t1 - t0) / a.steps)
            cross[m].append((b1 - b0) / a.steps)
            opt = built[m][1]
            if hasattr(opt, "compression_stats"):
                ph = opt.compression_stats()["phase_ms_last_step"]
                compute[m].append(sum(ph.get(k, 0.0) for k in ("encode", "owner", "final_decode")) / 1e3)
    stats = {m: built[m][1].compression_stats() for m in names if METHODS[m][0] == "hvdp"}
    # every rank's times: a step is as slow as its slowest rank
    out = {}
    for m in names:
        t = hvd.allgather(torch.tensor([times[m]], dtype=torch.float64), name=f"t.{m}").max(0).values.tolist()
        out[m] = {"step_s": t, "cross_bytes": cross[m], "codec_s": compute[m],
                  "median_s": statistics.median(t), "median_cross_bytes": statistics.median(cross[m])}
    for m, st in stats.items():
        out[m]["phase_ms"] = st["phase_ms"]
    if r == 0:
        with open(a.json_out, "w") as f:
            json.dump({"params": params, "grad_mb": 4 * params / 1e6, "width": a.width, "depth": a.depth,
                       "batch": a.batch, "rounds": a.rounds, "steps": a.steps, "methods": out,
                       "stats_last_step": {m: s["last_step"] for m, s in stats.items()}}, f, indent=1)
    hvd.barrier()  # no rank leaves (shutting Horovod down) while another still works


if __name__ == "__main__":
    main()
