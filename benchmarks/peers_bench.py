"""hvdp against DDP's communication hooks: step time and bytes on the wire, taking turns.

Run under ``horovodrun --gloo -np 2`` (``benchmarks/peers.py`` does, on each link). In the same
two processes: torch DDP over Gloo plain, with ``fp16_compress_hook``, ``bf16_compress_hook`` and
PowerSGD (rank 1 and 4, error feedback on, low-rank from ``--powersgd-start``), and hvdp's
DistributedOptimizer with none, fp16, bf16, int8 (and auto when hvdp offers it). Contenders take
turns, one iteration of ``--batches`` batches each, ``--iters`` times, so noise hits all alike.

Bytes on the wire: the loopback's transmit counter (``/sys/class/net/lo/statistics/tx_bytes``,
the network namespace's own when run inside one) read around each contender's batches, divided
by batches and ranks; for hvdp also its own count (``compression_stats()``), as a cross-check.
Rank 0 writes JSON.
"""
import argparse
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import hvdp.torch as hvd
from hvdp import config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mean_ci, ratio_ci, time_batches  # noqa: E402
from step_bench import build_model  # noqa: E402  (the same model as the step stages)

LO_TX = "/sys/class/net/lo/statistics/tx_bytes"


def tx_bytes():
    with open(LO_TX) as f:
        return int(f.read())


def ddp_contenders(base, powersgd_ranks, start, refused):
    """DDP models with each hook; a hook DDP refuses here (bf16 needs CUDA + NCCL) goes to
    ``refused`` with DDP's own message."""
    out, states = {}, []
    hooks = {"ddp": None, "ddp+fp16": (None, default_hooks.fp16_compress_hook),
             "ddp+bf16": (None, default_hooks.bf16_compress_hook)}
    for r in powersgd_ranks:
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                            start_powerSGD_iter=start, use_error_feedback=True,
                                            warm_start=True, random_seed=0)
        hooks[f"ddp+powersgd{r}"] = (state, powerSGD_hook.powerSGD_hook)
        states.append(state)
    for name, hook in hooks.items():
        m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        if hook is not None:
            try:
                m.register_comm_hook(*hook)
            except (TypeError, RuntimeError) as e:
                refused[name] = str(e)
                continue
        out[name] = (m, torch.optim.SGD(m.parameters(), lr=0.01), None)
    return out


def hvdp_contenders(base, codecs):
    out = {}
    for c in codecs:
        m = copy.deepcopy(base)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),
                                       named_parameters=[(f"{c}.{k}", p) for k, p in m.named_parameters()],
                                       compression=c)
        out[f"hvdp {c}"] = (m, opt, opt)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2560)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=11, help="auto probes, then tries 3 plans x 3 steps")
    ap.add_argument("--powersgd-ranks", default="1,4")
    ap.add_argument("--powersgd-start", type=int, default=2,
                    help="PowerSGD's start_powerSGD_iter: plain allreduce before it (its warm-up)")
    ap.add_argument("--codecs", default="none,fp16,bf16,int8,auto")
    ap.add_argument("--json-out", required=True)
    a = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config.ddp_port(29556)}",
                            rank=hvd.rank(), world_size=hvd.size())
    base = build_model(a.width, a.depth)
    x = torch.randn(a.batch, a.width)
    y = torch.randint(0, 10, (a.batch,))
    codecs = [c for c in a.codecs.split(",") if c != "auto" or hasattr(hvd.Compression, "auto")]
    refused = {}
    contenders = {**ddp_contenders(base, [int(r) for r in a.powersgd_ranks.split(",") if r], a.powersgd_start,
                                   refused),
                  **hvdp_contenders(base, codecs)}

    def step(model, opt):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for model, opt, _ in contenders.values():  # PowerSGD's warm-up iterations happen here too
        for _ in range(max(a.warmup, a.powersgd_start + 1)):
            step(model, opt)
    times = {k: [] for k in contenders}
    wire = {k: [] for k in contenders}
    for _ in range(a.iters):
        for k, (model, opt, _) in contenders.items():
            hvd.allreduce(torch.zeros(1), name="peers.barrier")  # start together
            dist.barrier()
            before = tx_bytes()
            times[k].append(time_batches(lambda: step(model, opt), a.batches))
            dist.barrier()  # both ranks' sends are counted before reading
            wire[k].append((tx_bytes() - before) / a.batches)
    worst = {k: [hvd.allreduce(torch.tensor(t), op=hvd.Max, name=f"peers.max.{k}.{i}").item()
                 for i, t in enumerate(v)] for k, v in times.items()}
    if hvd.rank() != 0:
        return
    own = {k: c[2].compression_stats() for k, c in contenders.items() if c[2] is not None}
    out = {"size": hvd.size(), "batch": a.batch, "params": sum(p.numel() for p in base.parameters()),
           "powersgd_start": a.powersgd_start, "refused": refused,
           "step_s": {k: mean_ci(v) for k, v in worst.items()},
           "ratio_over_ddp": {k: ratio_ci(v, worst["ddp"]) for k, v in worst.items()},
           # the namespace's loopback carries every rank's sends: per worker = / size
           "lo_bytes_per_step_per_worker": {k: mean_ci([b / hvd.size() for b in v]) for k, v in wire.items()},
           # hvdp's own count of the bytes it sent in its last step (per worker)
           "hvdp_sent_per_step_per_worker": {k: s["last_step"]["all"]["sent"] for k, s in own.items()},
           "hvdp_auto": {k: s["auto"] for k, s in own.items() if "auto" in s}}
    with open(a.json_out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
