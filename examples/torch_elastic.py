"""Elastic data-parallel training on digits: survives workers dying, joining and leaving.

Launch with Gloo and a host-discovery script (prints "host:slots" lines, one per host):

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script ./discover.sh --gloo \
        python examples/torch_elastic.py --compression int8

Every step is committed (model, optimizer incl. hvdp's error feedback, sample position); after
a failure the survivors roll back to the last commit and re-split the rest of the epoch.
With ``--log-dir``, every committed step's global sample ids are logged for auditing.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hvdp.torch as hvd  # noqa: E402
from elastic_audit import AuditLog, end_step  # noqa: E402
from torch_digits import load_data, make_model  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=0.02, help="per worker; scaled by the current size")
    p.add_argument("--compression", default="int8")
    p.add_argument("--log-dir", help="audit log of committed steps, and pid files")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (for demos/tests)")
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_data()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=args.compression)
    sampler = hvd.elastic.ElasticSampler(len(xtr), args.batch_size, seed=0)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, commits=0)
    log = AuditLog(args.log_dir)

    def on_reset():
        for g in opt.param_groups:  # keep lr = per-worker lr x current number of workers
            g["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            for idx in state.sampler:
                opt.zero_grad()
                loss_sum = 0.0
                if idx:
                    out = model(xtr[idx])
                    loss = torch.nn.functional.cross_entropy(out, ytr[idx])
                    loss.backward()
                    loss_sum = loss.item() * len(idx)
                opt.step()
                block = hvd.allgather_object((idx, loss_sum))  # this step's global sample ids
                end_step(state, block, hvd.size(), log, args.step_sleep)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    log.final([p.detach().numpy() for p in model.parameters()], hvd.size(), acc)
    if hvd.rank() == 0:
        print(f"done: {args.epochs} epochs, {state.commits} committed steps, {hvd.size()} workers at the end, "
              f"test accuracy {acc:.4f}", flush=True)


if __name__ == "__main__":
    main()
