"""A small two-rank convergence comparison of hvdp powersgd and DDP's powerSGD_hook (issue 36,
deliverable 4): the time-to-accuracy run's recipe (byte-level GPT, AdamW, clipping at 1.0, a
linear warm-up then cosine decay) on a smaller GPT, the runs taking turns step by step from the
same weights with the same batches. Not part of ``make test`` (minutes of CPU)::

    OMP_NUM_THREADS=1 horovodrun -np 2 -H localhost:2 --gloo python \
        tests/parallel/workers/psgd_convergence.py [steps] [ranks, e.g. 1,4] [Q seeds, e.g. 0,1]

Per rank and seed: DDP's hook with ``start_powerSGD_iter=10``, hvdp with no warm-up, and hvdp
with ``start_powerSGD_iter=10``; hvdp none as the float32 reference. Prints the held-out loss
every 25 steps and the last one.
"""
import contextlib
import copy
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import hvdp.torch as hvd

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from torch_gpt import GPT, batch, validate  # noqa: E402
from workload_data import stdlib_corpus  # noqa: E402
from workload_ddp import init_process_group, wrap  # noqa: E402

D, LAYERS, HEADS, CONTEXT, MICRO = 64, 2, 2, 64, 8
PEAK_LR, FLOOR, WARMUP, START = 2e-3, 0.1, 10, 10


def lr_factor(s, T):
    if s < WARMUP:
        return (s + 1) / WARMUP
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - WARMUP) / max(1, T - WARMUP))))


def main(steps, ranks, seeds):
    hvd.init()
    torch.set_num_threads(1)
    init_process_group()
    torch.manual_seed(0)
    base = GPT(LAYERS, D, HEADS, CONTEXT)
    train_data, val = stdlib_corpus()
    vargs = type("A", (), {"context": CONTEXT, "val_windows": 32})

    def adamw(params):
        return torch.optim.AdamW(params, lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.1)

    runs = []

    def hvdp_run(label, codec):
        m = copy.deepcopy(base)
        key = label.replace(" ", "_")
        opt = hvd.DistributedOptimizer(adamw(m.parameters()), compression=codec,
                                       named_parameters=[(f"{key}.{k}", p) for k, p in m.named_parameters()])
        runs.append((label, "hvdp", m, m, opt))

    hvdp_run("hvdp none", "none")
    for r in ranks:
        for seed in seeds:
            m, _ = wrap(copy.deepcopy(base), f"powersgd{r}", seed, START, bucket_cap_mb=1024)
            runs.append((f"ddp r{r} s{seed} start{START}", "ddp", m, m.module, adamw(m.parameters())))
            psgd = hvd.Compression.powersgd.configure(rank=r, seed=seed)
            hvdp_run(f"hvdp r{r} s{seed} start0", psgd)
            hvdp_run(f"hvdp r{r} s{seed} start{START}", psgd.configure(start_powerSGD_iter=START))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, steps)) for *_, o in runs]
    curves = {label: [] for label, *_ in runs}
    for step in range(steps):
        rng_seed = [0, step, hvd.rank()]
        for (label, kind, model, net, opt), sched in zip(runs, scheds):
            x, y = batch(train_data, np.random.default_rng(rng_seed), MICRO, CONTEXT)
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            if kind == "hvdp":
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                with opt.skip_synchronize():
                    opt.step()
            else:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
            sched.step()
            if (step + 1) % 25 == 0 or step + 1 == steps:
                curves[label].append((step + 1, validate(net, val, vargs, contextlib.nullcontext)))
    if hvd.rank() == 0:
        marks = [s for s, _ in curves["hvdp none"]]
        print("held-out loss at steps " + " ".join(f"{s:>6d}" for s in marks))
        for label, c in curves.items():
            print(f"{label:<24s} " + " ".join(f"{v:6.3f}" for _, v in c))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 200, [int(r) for r in (a[1] if len(a) > 1 else "1,4").split(",")],
         [int(s) for s in (a[2] if len(a) > 2 else "0").split(",")])
