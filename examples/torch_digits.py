"""The main job: a small network on scikit-learn's bundled digits, data-parallel with hvdp.

Each rank trains on its own shard of every epoch's shuffle; the learning rate is scaled by the
number of workers. Run it (two workers on this machine):

    horovodrun -np 2 -H localhost:2 python examples/torch_digits.py --compression int8
"""
import argparse
import json
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvdp.torch as hvd
from workload_torch import add_outer_args, distributed, ranks_max_diff, summary_line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05, help="for one worker; scaled by size")
    p.add_argument("--compression", default="none", help="none, fp16, bf16, int8, topk, powersgd, auto")
    p.add_argument("--topk-ratio", type=float, default=0.01)
    p.add_argument("--no-error-feedback", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=0.0, help="gradient norm clipping (0: none), as "
                   "examples/torch_gpt.py: the averaged gradients; with --sync-every each rank's own")
    p.add_argument("--json-out", help="rank 0 writes the final figures here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_outer_args(p)  # --sync-every H: hvd.OuterOptimizer instead (docs/outer-steps.md)
    return p.parse_args(argv)


def load_data(seed=0):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(xte), torch.from_numpy(yte).long())


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def describe_auto(auto, elapsed):
    """auto's decision per bucket, the figures behind it and the probe's share of the run."""
    lines = [f"auto: {auto['probes']} probe(s), {1e3 * auto['probe_wall_s']:.0f} ms "
             f"({100 * auto['probe_wall_s'] / elapsed:.2f}% of this run)"]
    for b in auto["buckets"]:
        pred = ", ".join(f"{k.split('(')[0]} {v:.2f}" for k, v in b["predicted_ms"].items())
        lines.append(f"  {b['bucket']} ({b['elements']} elements): {b['codec']}  [predicted ms: {pred or '-'}]")
    if auto["trial"]:
        t = auto["trial"]
        timed = ", ".join(f"{k} {v:.2f}" for k, v in t["ms"].items())
        lines.append(f"  trial ({t['steps']} steps each, ms/step): {timed}: kept {t['kept']}")
    costs = auto["costs"] or {}
    for k, v in costs.get("links_per_byte", {}).items():
        lines.append(f"  link {k}: {v['fixed_ms']:.3f} ms + {v['ns_per_unit']:.3f} ns/byte")
    for k, v in costs.get("compute_per_element", {}).items():
        lines.append(f"  codec {k}: {v['fixed_ms']:.3f} ms + {v['ns_per_unit']:.3f} ns/element")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    # hvd.DistributedOptimizer, or hvd.OuterOptimizer with --sync-every (examples/workload_torch.py)
    opt = distributed(opt, model, args)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    global_batch = args.batch_size * hvd.size()
    steps = len(xtr) // global_batch
    show = hvd.rank() == 0 and not args.quiet
    t0, seen = time.perf_counter(), 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        shard = order[:steps * global_batch][hvd.rank()::hvd.size()]
        model.train()
        bar = None
        if show:
            from tqdm import tqdm
            bar = tqdm(total=steps, desc=f"epoch {epoch + 1:2d}/{args.epochs}", leave=False, ncols=80)
        total = torch.zeros(2)
        for s in range(steps):
            idx = shard[s * args.batch_size:(s + 1) * args.batch_size]
            opt.zero_grad()
            out = model(xtr[idx])
            loss = torch.nn.functional.cross_entropy(out, ytr[idx])
            loss.backward()
            if args.clip and not args.sync_every:
                opt.synchronize()  # averaged gradients in p.grad: clip the global norm
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                with opt.skip_synchronize():
                    opt.step()
            else:
                if args.clip:  # between syncs each rank's own gradients (in a warm-up the averages)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
            total += torch.tensor([loss.item() * len(idx), (out.argmax(1) == ytr[idx]).sum().item()])
            seen += len(idx)
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        total = hvd.allreduce(total, op=hvd.Sum, name="epoch_metrics")
        if hvd.rank() == 0:
            n = steps * global_batch
            print(f"epoch {epoch + 1:2d}/{args.epochs}  loss {total[0] / n:.4f}  "
                  f"train acc {total[1] / n:.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        out = model(xte)
        acc = (out.argmax(1) == yte).float().mean().item()
        test_loss = torch.nn.functional.cross_entropy(out, yte).item()
    diff = ranks_max_diff(model)  # 0.0: every rank holds the same model
    rate = hvd.allreduce(torch.tensor(seen / elapsed), op=hvd.Sum, name="rate").item()
    stats = opt.compression_stats()
    if hvd.rank() == 0:
        codec, ratio, line = summary_line(opt)
        print(f"test accuracy {acc:.4f}  |  {rate:.0f} samples/s over {hvd.size()} worker(s)  |  {line}", flush=True)
        if "auto" in stats:
            print(describe_auto(stats["auto"], elapsed), flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"test_accuracy": acc, "test_loss": test_loss, "samples_per_s": rate,
                           "codec": codec, "wire_ratio": ratio, "size": hvd.size(),
                           "seed": args.seed, "elapsed_s": elapsed, "steps": steps * args.epochs,
                           "global_batch": global_batch, "ranks_max_diff": diff, "auto": stats.get("auto")}, f)
    return acc


if __name__ == "__main__":
    main()
