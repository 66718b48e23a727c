"""Checks of hvd.OuterOptimizer (outer steps, hvdp.outer) that need real workers. Each rank runs
the named checks in order and prints 'CHECK <name> OK rank=<r>'; a failed check raises, which
fails the horovodrun job."""
import copy
import io
import socket
import sys

import torch

import hvdp.torch as hvd

STEPS = 20


def model_and_data(seed=0, n=64):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.BatchNorm1d(64),
                                torch.nn.Linear(64, 3))
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 20, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    per = n // hvd.size()
    sl = slice(hvd.rank() * per, (hvd.rank() + 1) * per)
    return model, x[sl], y[sl]


def batch(x, y, step, size=8):
    i = (step * size) % len(x)
    return x[i:i + size], y[i:i + size]


def train(model, opt, x, y, steps, first=0, on_sync=None):
    for s in range(first, steps):
        bx, by = batch(x, y, s)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(bx), by).backward()
        opt.step()
        if on_sync is not None and (s + 1) % on_sync[0] == 0:
            on_sync[1](s + 1)


def train_in_halves(model, opt, x, y, steps):
    """``train`` with two backward passes of half a batch before each step (accumulation)."""
    for s in range(steps):
        bx, by = batch(x, y, s)
        opt.zero_grad()
        for half in (0, 4):
            torch.nn.functional.cross_entropy(model(bx[half:half + 4]), by[half:half + 4]).backward()
        opt.step()


def same_on_every_rank(model, step):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather_object(flat, name=f"outer.same.{step}")
    assert all(torch.equal(every[0], f) for f in every), f"ranks differ after the sync at step {step}"


def close(a, b, tol):
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        err = (p - q).abs().max().item()
        assert err <= tol, f"{k}: max |diff| {err:.3g} > {tol}"


def check_data_parallelism():
    """H = 1, outer lr 1, no momentum: hvd.DistributedOptimizer(compression='none')'s training."""
    model, x, y = model_and_data()
    dp_model = copy.deepcopy(model)
    opt = hvd.OuterOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                             sync_every=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    dp = hvd.DistributedOptimizer(torch.optim.SGD(dp_model.parameters(), lr=0.1),
                                  named_parameters=dp_model.named_parameters())
    train(model, opt, x, y, STEPS)
    train(dp_model, dp, x, y, STEPS)
    close(model, dp_model, 1e-5)
    same_on_every_rank(model, "dp")


def check_ranks_identical_int8():
    """DiLoCo (H 4, Nesterov 0.7/0.9) with AdamW inside and int8 pseudo-gradients: every rank's
    parameters are the same bits after every sync, and the job trains (its loss falls)."""
    model, x, y = model_and_data()
    opt = hvd.OuterOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), named_parameters=model.named_parameters(),
                             sync_every=4, compression="int8", buffers=model.named_buffers())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = torch.nn.functional.cross_entropy(model.eval()(x), y).item()
    model.train()
    train(model, opt, x, y, STEPS, on_sync=(4, lambda s: same_on_every_rank(model, s)))
    bn = [b for k, b in model.named_buffers() if k.endswith("running_mean")][0]
    every = hvd.allgather_object(bn.clone(), name="outer.bn")
    assert torch.equal(every[0], every[-1]), "batch-norm statistics not averaged at the sync"
    after = torch.nn.functional.cross_entropy(model.eval()(x), y).item()
    assert after < before, (before, after)
    stats = opt.compression_stats()
    per_step, fp32 = stats["sent_per_inner_step"], stats["fp32_per_step_of_data_parallelism"]
    # a sync every 4th step; int8 for the 20x64 weight, float32 for the tensors under the policy's size
    assert 0 < per_step * 4 < fp32 * 0.5, (per_step, fp32)
    if hvd.rank() == 0:
        print(f"outer int8 H=4: {per_step:.0f} B per inner step vs {fp32:.0f} B for float32 data parallelism")


class torch_group:
    """torch.distributed's Gloo group over the same ranks, for the peer's implementation."""

    def __enter__(self):
        import torch.distributed as dist
        port = None
        if hvd.rank() == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = hvd.broadcast_object(port, 0, name="outer.port")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                                world_size=hvd.size())
        return dist

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.destroy_process_group()


def check_post_local_sgd():
    """Outer lr 1 without momentum against PyTorch's PostLocalSGDOptimizer + PeriodicModelAverager
    (its averager at every 4th call: warmup_steps=3) on the same model and data."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    with torch_group():
        model, x, y = model_and_data()
        theirs = copy.deepcopy(model)
        opt = hvd.OuterOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                 named_parameters=model.named_parameters(), sync_every=4, outer_lr=1.0,
                                 outer_momentum=0.0, nesterov=False)
        local = PostLocalSGDOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9),
                                      PeriodicModelAverager(period=4, warmup_steps=3))
        for s in range(STEPS):
            for m, o in ((model, opt), (theirs, local)):
                bx, by = batch(x, y, s)
                o.zero_grad()
                torch.nn.functional.cross_entropy(m(bx), by).backward()
                o.step()
        close(model, theirs, 1e-5)


def check_warmup_post_local_sgd():
    """warmup_steps=W: W synchronous steps, then averaging every 4th step, against DDP with
    post_localSGD_hook(start_localSGD_iter=W) (gradients averaged for W steps; a subgroup of one
    rank after them, as two nodes) + PostLocalSGDOptimizer's averager at the same steps."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pls
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    W = 5
    with torch_group() as dist:
        model, x, y = model_and_data()
        theirs = copy.deepcopy(model)
        opt = hvd.OuterOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 named_parameters=model.named_parameters(), sync_every=4, outer_lr=1.0,
                                 outer_momentum=0.0, nesterov=False, warmup_steps=W)
        own, _ = dist.new_subgroups(group_size=1)
        ddp = torch.nn.parallel.DistributedDataParallel(theirs, broadcast_buffers=False)
        ddp.register_comm_hook(pls.PostLocalSGDState(process_group=None, subgroup=own, start_localSGD_iter=W),
                               pls.post_localSGD_hook)
        local = PostLocalSGDOptimizer(torch.optim.AdamW(theirs.parameters(), lr=1e-2),
                                      PeriodicModelAverager(period=4, warmup_steps=W + 3))
        for s in range(STEPS):
            for m, o in ((model, opt), (ddp, local)):
                bx, by = batch(x, y, s)
                o.zero_grad()
                torch.nn.functional.cross_entropy(m(bx), by).backward()
                o.step()
            if s == W - 1:  # the warm-up keeps every rank the same
                same_on_every_rank(model, s + 1)
        close(model, theirs, 2e-5)
        assert opt.outer.warm == W and opt.outer.step == STEPS - W


def check_warmup_codec():
    """warmup_compression="int8": the W warm-up steps are hvd.DistributedOptimizer(compression=
    "int8")'s steps (the same bits: the same engine, codec, residuals and the policy's own
    float32 steps first), every rank the same
    after them, the warm-up's bytes in compression_stats(); a checkpoint in the middle of the
    warm-up (its residuals saved) resumes to the uninterrupted run's bits at step 14."""
    W, pol = 5, hvd.CompressionPolicy(min_elements=1, warmup_steps=2)  # the policy's own 2 float32 steps first

    def make():
        model, x, y = model_and_data()
        opt = hvd.OuterOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 named_parameters=model.named_parameters(), sync_every=4, compression="int8",
                                 warmup_steps=W, warmup_compression="int8", policy=pol)
        return model, opt, x, y
    model, opt, x, y = make()
    dp_model = copy.deepcopy(model)
    dp = hvd.DistributedOptimizer(torch.optim.AdamW(dp_model.parameters(), lr=1e-2),
                                  named_parameters=dp_model.named_parameters(), compression="int8", policy=pol)
    train(model, opt, x, y, W)
    train(dp_model, dp, x, y, W)
    worst = max((p - q).abs().max().item() for p, q in zip(model.parameters(), dp_model.parameters()))
    assert worst == 0.0, f"the int8 warm-up differs from hvd.DistributedOptimizer(compression='int8'): {worst:.3g}"
    same_on_every_rank(model, "warm")
    warm = opt.compression_stats()["warmup"]
    last, total = warm["last_step"]["all"], warm["total"]["all"]  # the last step int8, the first ones float32
    assert 0 < last["sent"] < 0.4 * last["fp32"] and last["sent"] < total["sent"] < total["fp32"], warm
    # a warm-up step's averages are in p.grad as backward returns (reduced from the gradient hooks:
    # a clip before step() sees them, as with DDP); after the warm-up backward leaves local gradients
    def grads_after_backward(m, o, s):
        bx, by = batch(x, y, s)
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(bx), by).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        every = hvd.allgather_object(flat, name=f"outer.warm.grads.{s}")
        o.step()
        return all(torch.equal(every[0], f) for f in every)
    assert not grads_after_backward(model, opt, W), "the gradients were averaged after the warm-up"
    model, opt, x, y = make()
    assert grads_after_backward(model, opt, 0), "a warm-up step's averages were not in p.grad after backward"
    # gradient accumulation in the warm-up: backward_passes_per_step as hvd.DistributedOptimizer's
    got = []
    for outer in (True, False):
        m, x, y = model_and_data()
        inner = torch.optim.AdamW(m.parameters(), lr=1e-2)
        o = (hvd.OuterOptimizer(inner, named_parameters=m.named_parameters(), sync_every=4, warmup_steps=W,
                                warmup_compression="int8", policy=pol, backward_passes_per_step=2) if outer else
             hvd.DistributedOptimizer(inner, named_parameters=m.named_parameters(), compression="int8", policy=pol,
                                      backward_passes_per_step=2))
        train_in_halves(m, o, x, y, 3)
        got.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*got)), "the accumulating warm-up differs from DistributedOptimizer's"
    # without backward_passes_per_step each pass is averaged as it ends (as DDP without no_sync):
    # float32, the same average as with it, within rounding
    got = []
    for passes in (2, 1):
        m, x, y = model_and_data()
        o = hvd.OuterOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                               sync_every=4, warmup_steps=W, backward_passes_per_step=passes)
        train_in_halves(m, o, x, y, 3)
        got.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    err = (got[0] - got[1]).abs().max().item()
    assert 0 <= err <= 1e-6, f"a warm-up averaged pass by pass differs from one averaged once: {err:.3g}"
    # a checkpoint after step 3 of the 5 warm-up steps
    model, opt, x, y = make()
    train(model, opt, x, y, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, x, y, 14, first=3)
    assert opt.outer.warm == W and opt.outer.step == 14 - W
    for keep in (True, False):
        model2, opt2, _, _ = make()
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        if not keep:  # without the warm-up engine's residuals: other bits (the check can see them)
            saved["opt"]["hvdp"]["engines"] = saved["opt"]["hvdp"]["engines"][:-1]
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
        train(model2, opt2, x, y, 14, first=3)
        equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
        assert equal == keep, ("the resumed run differs from the uninterrupted one" if keep else
                               "without the warm-up residuals the run is the same: the check cannot see them")


def check_join_warmup_codec():
    """Uneven inputs inside an int8 warm-up (W 8): rank 1 joins after 3 steps, rank 0 takes 8;
    the same bits as hvd.DistributedOptimizer(compression="int8") with the same join (its steps
    after the join reduced in float32, the joined rank adding zeros), both ranks the same after it."""
    pol, mine = hvd.CompressionPolicy(min_elements=1), (8 if hvd.rank() == 0 else 3)
    got = []
    for outer in (True, False):
        model, x, y = model_and_data()
        model.eval()  # no batch-norm statistics in the way
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = (hvd.OuterOptimizer(inner, named_parameters=model.named_parameters(), sync_every=4, warmup_steps=8,
                                  warmup_compression="int8", policy=pol) if outer else
               hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression="int8",
                                        policy=pol))
        train(model, opt, x, y, mine)
        assert hvd.join() == 0
        same_on_every_rank(model, f"join.warm.{outer}")
        got.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*got)), "the warm-up with a join differs from DistributedOptimizer's"


def check_checkpoint_mid_interval():
    """A checkpoint at step 6 (H 4: inside the second interval), loaded into fresh objects,
    trains on to the uninterrupted run's bits."""
    def make():
        model, x, y = model_and_data()
        opt = hvd.OuterOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 named_parameters=model.named_parameters(), sync_every=4, compression="int8")
        return model, opt, x, y
    model, opt, x, y = make()
    train(model, opt, x, y, 6)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, x, y, 14, first=6)
    model2, opt2, _, _ = make()
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(model2, opt2, x, y, 14, first=6)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q), "the resumed run differs from the uninterrupted one"


def check_save_checkpoint():
    """hvd.save_checkpoint / hvd.load_checkpoint (rank 0 writes; each rank gets its own
    residuals back) in the middle of an interval: the resumed run has the uninterrupted one's bits."""
    import os
    import tempfile

    def make():
        model, x, y = model_and_data()
        opt = hvd.OuterOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 named_parameters=model.named_parameters(), sync_every=4, compression="int8",
                                 policy=hvd.CompressionPolicy(min_elements=1))
        return model, opt, x, y
    folder = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvdp-outer-") if hvd.rank() == 0 else None, 0,
                                  name="outer.ckpt.dir")
    path = os.path.join(folder, "ckpt.pt")
    model, opt, x, y = make()
    train(model, opt, x, y, 6)
    hvd.save_checkpoint(path, model, opt, step=6)
    train(model, opt, x, y, 14, first=6)
    model2, opt2, _, _ = make()
    assert hvd.load_checkpoint(path, model2, opt2) == {"step": 6}
    train(model2, opt2, x, y, 14, first=6)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q), "the resumed run differs from the uninterrupted one"


def check_join():
    """Uneven inputs: rank 1 stops after 10 steps (inside an interval of H = 4) and calls
    hvd.join(); rank 0 goes on to 22. With codec none, rank 0's syncs after the join average its
    own pseudo-gradient alone: equal (1e-6) to outer Nesterov SGD on it, computed here; with int8
    (two-phase: reduced in float32 while a rank has joined), no crash or hang. After the join both
    ranks hold the same parameters and outer state; a join with a fragment in flight is refused."""
    import copy as _copy
    for codec in ("none", "int8"):
        model, x, y = model_and_data()
        model.eval()  # no batch-norm statistics in the way: the reference below is the parameters'
        opt = hvd.OuterOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                 named_parameters=model.named_parameters(), sync_every=4, compression=codec,
                                 policy=hvd.CompressionPolicy(min_elements=1))
        mine = 10 if hvd.rank() == 1 else 22
        train(model, opt, x, y, 10)
        if hvd.rank() == 0:  # the reference from here: this rank alone, outer SGD lr 0.7, momentum 0.9, Nesterov
            ref = _copy.deepcopy(model)
            glob = [g.clone().reshape(p.shape) for g, p in zip(opt.outer.globals, ref.parameters())]
            mom = [m.clone().reshape(p.shape) for m, p in zip(opt.outer.momentum, ref.parameters())]
            for s in range(10, 22):
                bx, by = batch(x, y, s)
                ref.zero_grad()
                torch.nn.functional.cross_entropy(ref(bx), by).backward()
                with torch.no_grad():
                    for p in ref.parameters():
                        p -= 0.05 * p.grad
                    if (s + 1) % 4 == 0:
                        for i, p in enumerate(ref.parameters()):
                            g = glob[i] - p
                            mom[i] = 0.9 * mom[i] + g
                            glob[i] = glob[i] - 0.7 * (g + 0.9 * mom[i])
                            p.copy_(glob[i])
        train(model, opt, x, y, mine, first=10)
        last = hvd.join()
        assert last == 0, last
        same_on_every_rank(model, f"join.{codec}")
        state = hvd.allgather_object([opt.outer.step, opt.outer.outer_steps,
                                      [g.sum().item() for g in opt.outer.globals]], name=f"outer.join.state.{codec}")
        assert state[0] == state[1], state
        if codec == "none" and hvd.rank() == 0:
            close(model, ref, 1e-6)
    model, x, y = model_and_data()
    opt = hvd.OuterOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                             sync_every=4, fragments=2, delay=1)
    train(model, opt, x, y, 4)  # fragment 0 synced at step 4, lands at 5: in flight
    try:
        hvd.join()
    except RuntimeError as e:
        assert "fragment in flight" in str(e), str(e)
    else:
        raise AssertionError("hvd.join() with a fragment in flight was accepted")
    train(model, opt, x, y, 8, first=4)  # both ranks go on (the refusal came before Horovod's join)
    model, x, y = model_and_data()
    opt = hvd.OuterOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                             sync_every=4)
    train(model, opt, x, y, 3)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()  # step 4 ends with a sync
    try:
        hvd.join()
    except RuntimeError as e:
        assert "join control is already sent" in str(e), str(e)
    else:
        raise AssertionError("hvd.join() between the backward and the step() of a sync step was accepted")
    opt.step()
    same_on_every_rank(model, "join.after_refusal")


def check_auto():
    """sync_every="auto": after the probe (6 inner steps) every rank reports the same chosen H
    and figures, the probe's sync leaves the ranks with the same bits, and the next syncs come
    every H steps from there."""
    model, x, y = model_and_data()
    opt = hvd.OuterOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                             named_parameters=model.named_parameters(), sync_every="auto", compression="int8")
    assert opt.compression_stats()["sync_every_auto"] is None
    train(model, opt, x, y, 6)
    chosen = opt.compression_stats()["sync_every_auto"]
    every = hvd.allgather_object(chosen, name="outer.auto.chosen")
    assert chosen is not None and all(c == every[0] for c in every), every
    same_on_every_rank(model, "auto.probe")
    h = chosen["sync_every"]
    assert opt.compression_stats()["sync_every"] == h and 1 <= h <= 500
    if h <= 20:
        train(model, opt, x, y, 6 + h, first=6)
        same_on_every_rank(model, "auto.next")
    print(f"sync_every auto on rank {hvd.rank()}: {chosen}", flush=True)


def check_streaming_overlap():
    """Streaming (H 2, two fragments, tau 1, int8 and int4): a fragment's second phase started
    from the gradient hooks of the inner step before it lands (``OuterLoop.progress``) gives the
    same bits as with ``HVDP_OVERLAP=0`` (started at landing), and with overlap on it does start
    early in some steps (counted just after ``loss.backward()``)."""
    import os

    from overlap_checks import _data, _model

    def train_streaming(codec, overlap):
        os.environ["HVDP_OVERLAP"] = "1" if overlap else "0"
        try:
            model = _model()
            opt = hvd.OuterOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters(), sync_every=2, fragments=2, delay=1,
                                     compression=codec, policy=hvd.CompressionPolicy(min_elements=1000))
        finally:
            os.environ.pop("HVDP_OVERLAP")
        x, y = _data()
        ahead = 0
        for _ in range(8):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            loop = opt.outer
            ahead += bool(loop is not None and loop.in_flight and all(
                p.phase >= 2 for f in loop._inflight for p in loop.engines[f]._pending.values()))
            opt.step()
        opt.outer.drain()  # the last fragment in flight, before the next run or the job's end
        return [p.detach().clone() for p in model.parameters()], ahead

    for codec in ("int8", "int4"):
        late, late_ahead = train_streaming(codec, False)
        early, ahead = train_streaming(codec, True)
        assert late_ahead == 0, f"{codec}: HVDP_OVERLAP=0 yet a fragment's second phase started before landing"
        for i, (a, b) in enumerate(zip(late, early)):
            assert torch.equal(a, b), f"{codec}: parameter {i} differs with overlap: {(a - b).abs().max():.3g}"
        assert ahead > 0, f"{codec}: in none of 7 landings had the second phase started before step()"
        print(f"STREAMING OVERLAP {codec} rank={hvd.rank()} landings_ahead={ahead}/7", flush=True)


def check_refusals():
    model, _, _ = model_and_data()
    # warmup_steps not given: rank 0 warns once; given (0 too): no warning
    import warnings
    from hvdp.outer import NoWarmupWarning
    for kwargs, warned in (({}, hvd.rank() == 0), ({"warmup_steps": 0}, False)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            hvd.OuterOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                               sync_every=4, **kwargs)
        got = [w for w in seen if issubclass(w.category, NoWarmupWarning)]
        assert len(got) == int(warned), (kwargs, [str(w.message) for w in got])
    for kwargs, text in (({}, "needs sync_every=H"), ({"sync_every": 4, "compression": "powersgd"}, "not one here"),
                         ({"sync_every": 4, "delay": 4}, "must be below sync_every"),
                         ({"sync_every": 4, "hierarchical": True}, "do not combine with the two-level reduction"),
                         ({"sync_every": 4, "warmup_steps": 2, "warmup_compression": "powersgd"}, "not one here"),
                         ({"sync_every": 4, "warmup_compression": "int8"}, "without warmup_steps")):
        try:
            hvd.OuterOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        except ValueError as e:
            assert text in str(e), str(e)
        else:
            raise AssertionError(f"{kwargs} was accepted")


if __name__ == "__main__":
    hvd.init()
    for name in sys.argv[1:]:
        globals()[f"check_{name}"]()
        print(f"CHECK {name} OK rank={hvd.rank()}", flush=True)
