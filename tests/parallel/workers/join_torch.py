"""hvdp.torch with uneven inputs: rank r runs ``steps[r]`` steps, then ``hvd.join()``.

Usage: join_torch.py STEPS MODE:CODEC[,CODEC...] [MODE:CODEC[,...] ...]  (the groups run in turn)
  MODE: default, opt-in, refuse or adam (below).
  STEPS: per-rank step counts, e.g. 5,4 or 5,3,4.
  default: the optimizer made as in a Horovod script, without ``uneven_inputs`` (the default
    turns the join control on).
  opt-in: with an explicit ``uneven_inputs=True``.
  refuse: ``uneven_inputs=False`` (expects JoinRefused on the rank that joins first).
  adam: Adam with momentum state (default ``uneven_inputs``): after join the optimizer state is
    identical on every rank too.
Prints 'CHECK join-<codec> OK rank=<r> err=... bound=...' per codec.
"""
import sys

import numpy as np
import torch

import hvdp.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from join_reference import check_uneven_run  # noqa: E402

LR = 0.1
DEFAULT = object()  # make the optimizer without the uneven_inputs argument


def residual_state(opt):
    red = opt.state_dict()["hvdp"]["reducer"]
    if red is None:
        return None
    return {k: {b: t.detach().clone().numpy() for b, t in red[k].items()} for k in ("worker", "server")}


def run(codec, steps, uneven_inputs=DEFAULT):
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    params = list(model.parameters())
    p0 = [p.detach().clone().numpy() for p in params]
    kw = {} if uneven_inputs is DEFAULT else dict(uneven_inputs=uneven_inputs)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(), compression=codec, **kw)
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = torch.randn(steps[rank], 8, 20, generator=g), torch.randint(0, 3, (steps[rank], 8), generator=g)
    local, res_after = [], []
    for t in range(steps[rank]):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[t]), y[t])
        local.append([gr.numpy().copy() for gr in torch.autograd.grad(loss, params, retain_graph=True)])
        loss.backward()
        opt.step()
        res_after.append(residual_state(opt))
    last = hvd.join()
    if uneven_inputs is not False:  # the default resolved to the join control, as True does
        assert opt.engine.settings.uneven_inputs is True, opt.engine.settings
        assert (opt._join is not None) == opt.engine.settings.two_phase, codec
    assert last == int(np.argmax(steps)), (last, steps)

    # identical on every rank, step counts too
    for i, p in enumerate(params):
        allp = hvd.allgather(p.detach().reshape(1, -1), name=f"join.ident.{codec}.{i}")
        assert all(torch.equal(allp[0], allp[r]) for r in range(size)), f"{codec}: param {i} differs"
    counts = hvd.allgather_object(opt.engine.step, name=f"join.count.{codec}")
    assert counts == [max(steps)] * size, counts

    # residual rule
    res = residual_state(opt)
    if res is not None:
        for b in res["worker"]:
            if steps[rank] < max(steps):   # joined early: its worker residual is kept
                np.testing.assert_array_equal(res["worker"][b], res_after[-1]["worker"][b])
            else:                           # ran steps with a rank joined: flushed into them
                assert not np.any(res["worker"][b]), f"{codec}: worker residual not flushed"
            t_even = min(steps) - 1         # last step with every rank active
            np.testing.assert_array_equal(res["server"][b], res_after[t_even]["server"][b])

    # against the replayed contributions
    every_local = hvd.allgather_object(local, name=f"join.local.{codec}")
    every_res = hvd.allgather_object(res, name=f"join.res.{codec}") if res is not None else None
    buckets = [tuple(idx) for idx in opt.engine.plan.buckets]
    final = [p.detach().numpy() for p in params]
    err, bound = check_uneven_run(codec, every_local, steps, size, p0, final, LR, every_res, buckets)
    how = "default" if uneven_inputs is DEFAULT else uneven_inputs
    print(f"CHECK join-{codec} OK rank={rank} uneven_inputs={how} err={err:.3g} bound={bound:.3g}", flush=True)


def refuse(codec, steps):
    """With uneven_inputs=False: the first rank to join raises JoinRefused; the others fail too."""
    try:
        run(codec, steps, uneven_inputs=False)
    except hvd.JoinRefused as e:
        print(f"REFUSED rank={hvd.rank()}: {e}", flush=True)
        raise


def adam(codec, steps):
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(), compression=codec)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps[rank]):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(8, 20, generator=g)),
                                          torch.randint(0, 3, (8,), generator=g)).backward()
        opt.step()
    before = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    hvd.join()
    tensors = [p.detach() for p in model.parameters()] + [opt.state[p][k] for p in model.parameters()
                                                          for k in ("exp_avg", "exp_avg_sq", "step")]
    for i, t in enumerate(tensors):
        every = hvd.allgather(t.reshape(1, -1).float(), name=f"join.adam.{codec}.{i}")
        assert all(torch.equal(every[0], every[r]) for r in range(hvd.size())), f"{codec}: tensor {i} differs"
    if steps[rank] < max(steps):  # the state really came from the last rank to join
        assert not all(torch.equal(b, opt.state[p]["exp_avg"]) for b, p in zip(before, model.parameters()))
    print(f"CHECK join-adam-{codec} OK rank={rank}", flush=True)


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    steps = [int(s) for s in sys.argv[1].split(",")]
    assert len(steps) == hvd.size(), (steps, hvd.size())
    modes = {"default": run, "opt-in": lambda c, s: run(c, s, uneven_inputs=True), "refuse": refuse, "adam": adam}
    for group in sys.argv[2:]:  # "mode:codec,codec,...", in turn in one job (each joins, then goes on)
        mode, _, names = group.partition(":")
        for name in names.split(","):
            modes[mode](name, steps)
