"""Elastic data-parallel training on digits: survives workers dying, joining and leaving.

Launch with Gloo and a host-discovery script (prints "host:slots" lines, one per host):

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script ./discover.sh --gloo \
        python examples/torch_elastic.py --compression int8

Every step is committed (model, optimizer incl. hvdp's error feedback, sample position); after
a failure the survivors roll back to the last commit and re-split the rest of the epoch.
With ``--log-dir``, every committed step's global sample ids are logged for auditing.

With ``--outer-every H``, outer steps (``hvd.OuterOptimizer``: DiLoCo, inner SGD with a fixed lr)
instead of a gradient exchange every step; every commit carries the outer state, and after a
reset every worker restarts from the global parameters. The model evaluated at the end is the
global one. ``--die-at N`` (tests): the worker on ``--die-host`` kills itself (SIGKILL) right
after committing step N, so the failure falls at a chosen point of the interval.
``--checkpoint PATH``: also ``hvd.save_checkpoint`` every ``--checkpoint-every`` commits (the kill
loop, tests/parallel/kill_loop.py, kills workers while it writes).
"""
import argparse
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hvdp.torch as hvd  # noqa: E402
from elastic_audit import AuditLog, digest, end_step  # noqa: E402
from torch_digits import load_data, make_model  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=0.02, help="per worker; scaled by the current size")
    p.add_argument("--compression", default="int8")
    p.add_argument("--log-dir", help="audit log of committed steps, and pid files")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (for demos/tests)")
    p.add_argument("--outer-every", type=int, default=0, help="H: outer steps every H inner steps (0: off)")
    p.add_argument("--warmup-steps", type=int, default=0, help="W: synchronous steps before the outer steps")
    p.add_argument("--warmup-compression", default="none", help="the warm-up steps' codec")
    p.add_argument("--die-at", type=int, default=0, help="commit after which the worker on --die-host dies")
    p.add_argument("--die-host", default="127.0.0.1")
    p.add_argument("--checkpoint", help="hvd.save_checkpoint to this path every --checkpoint-every commits")
    p.add_argument("--checkpoint-every", type=int, default=10)
    args = p.parse_args()
    dies = args.die_at and os.environ.get("HOROVOD_HOSTNAME") == args.die_host

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_data()
    model = make_model()
    if args.outer_every:
        opt = hvd.OuterOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                 named_parameters=model.named_parameters(), sync_every=args.outer_every,
                                 compression=args.compression, warmup_steps=args.warmup_steps,
                                 warmup_compression=args.warmup_compression)
    else:
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=args.compression)
    sampler = hvd.elastic.ElasticSampler(len(xtr), args.batch_size, seed=0)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, commits=0)
    log = AuditLog(args.log_dir)

    def on_reset():
        for g in opt.param_groups:  # keep lr = per-worker lr x current number of workers
            g["lr"] = args.lr * hvd.size()

    if not args.outer_every:  # inner steps are local: their lr does not scale with the workers
        state.register_reset_callbacks([on_reset])

    def outer_record():
        loop = getattr(opt, "outer", None)
        if loop is None:
            return None
        return {"outer": {"step": loop.step, "warm": loop.warm, "outer_steps": list(loop.outer_steps),
                          "globals": digest([g.numpy() for g in loop.globals])}}

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
                end_step(state, block, hvd.size(), log, args.step_sleep, outer_record(), hvd.rank())
                if args.checkpoint and state.commits % args.checkpoint_every == 0:
                    hvd.save_checkpoint(args.checkpoint, model, opt, commits=state.commits)
                if dies and state.commits == args.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    with torch.no_grad():
        if args.outer_every:  # the global parameters (the inner steps since the last sync are local)
            for p, g in zip(model.parameters(), opt.outer.globals):
                p.copy_(g)
        out = model(xte)
        acc = (out.argmax(1) == yte).float().mean().item()
        test_loss = torch.nn.functional.cross_entropy(out, yte).item()
    log.final([p.detach().numpy() for p in model.parameters()], hvd.size(), acc, test_loss=test_loss,
              **(outer_record() or {}))
    if hvd.rank() == 0:
        print(f"done: {args.epochs} epochs, {state.commits} committed steps, {hvd.size()} workers at the end, "
              f"test accuracy {acc:.4f}, test loss {test_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
