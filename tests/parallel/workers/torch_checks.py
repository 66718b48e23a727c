"""Checks of hvdp.torch that need real workers. Each rank runs the named checks in order and
prints 'CHECK <name> OK rank=<r>'; a failed check raises, which fails the horovodrun job."""
import copy
import sys
import warnings

import torch

import hvdp.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from reduction_bounds import check_reduced  # noqa: E402

TOL = 1e-5  # float32 training of a few steps: summation order differs between 1 and 2 workers


def model_and_data(seed=0, n=64):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 20, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return model, x, y


def params_close(a, b, tol=TOL):
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        err = (p - q).abs().max().item()
        assert err <= tol, f"{k}: max |diff| {err:.3g} > {tol}"


def ranks_identical(model):
    for k, p in model.named_parameters():
        allp = hvd.allgather(p.detach().reshape(1, -1), name=f"ident.{k}")
        assert torch.equal(allp[0], allp[-1]), f"{k} differs between ranks"


def my_slice(n):
    per = n // hvd.size()
    return slice(hvd.rank() * per, (hvd.rank() + 1) * per)


def check_grad_average():
    model, x, y = model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    local = copy.deepcopy(model)
    sl = my_slice(len(x))
    torch.nn.functional.cross_entropy(local(x[sl]), y[sl]).backward()
    torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
    opt.synchronize()
    for (k, p), q in zip(model.named_parameters(), local.parameters()):
        everyone = hvd.allgather(q.grad.reshape(1, -1), name=f"ga.{k}")
        exact = everyone.double().mean(0).reshape(p.shape)
        assert (p.grad.double() - exact).abs().max() <= 1e-6, k


def train(model, opt, x, y, steps, bpps=1):
    for _ in range(steps):
        opt.zero_grad()
        for xb, yb in zip(x.chunk(bpps), y.chunk(bpps)):
            (torch.nn.functional.cross_entropy(model(xb), yb) / bpps).backward()
        opt.step()


def check_two_workers_equal_one(bpps=1, steps=5):
    model, x, y = model_and_data(n=16 * hvd.size() * bpps)
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=bpps)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    # each rank: its own contiguous share of every pass; the reference sees the whole batch
    per_pass = len(x) // bpps
    mine = torch.cat([torch.arange(k * per_pass, (k + 1) * per_pass)[my_slice(per_pass)]
                      for k in range(bpps)])
    train(model, opt, x[mine], y[mine], steps, bpps)
    for _ in range(steps):
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    params_close(model, ref)
    ranks_identical(model)


def check_broadcast():
    model, x, y = model_and_data(seed=100 + hvd.rank())  # different initial weights per rank
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(), compression="int8")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    ranks_identical(model)
    train(model, opt, x[my_slice(len(x))], y[my_slice(len(x))], 2)
    ranks_identical(model)
    st = opt.state_dict()["state"][0]["exp_avg"]
    allst = hvd.allgather(st.reshape(1, -1), name="bcast.state")
    assert torch.equal(allst[0], allst[-1])


def check_amp_gradscaler():
    """Horovod's documented recipe: synchronize, unscale_, clip, step under skip_synchronize."""
    model, x, y = model_and_data(n=32 * hvd.size())
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler, ref_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    sl = my_slice(len(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step() after synchronize()" double reduction
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x[sl]), y[sl])
            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
    for _ in range(3):
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(ref(x), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 10.0)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    assert scaler.get_scale() == ref_scaler.get_scale()  # no step skipped
    params_close(model, ref, tol=2e-2)  # bf16 autocast on half vs whole batch rounds differently
    ranks_identical(model)


def check_codecs():
    for name in ["fp16", "bf16", "int8", "int4", "topk"]:
        model, x, y = model_and_data(seed=7)
        twin = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=name,
                                       policy=hvd.CompressionPolicy(min_elements=1))
        sl = my_slice(len(x))
        torch.nn.functional.cross_entropy(twin(x[sl]), y[sl]).backward()
        torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.synchronize()
        everyone = [hvd.allgather(q.grad.reshape(1, -1), name=f"cd.{name}.{i}")
                    for i, q in enumerate(twin.parameters())]
        per_rank = [[e[r].numpy() for e in everyone] for r in range(hvd.size())]
        got = [p.grad.reshape(-1).numpy() for p in model.parameters()]
        err = check_reduced(opt.engine.settings.codec, per_rank, got, opt.engine.plan.buckets)
        print(f"  {name}: max |err| vs exact average {err:.3g}", flush=True)


def check_powersgd(rank=2, steps=4):
    """powersgd through the DistributedOptimizer: the first step's averaged gradients against the
    float64 numpy replay of both ranks' gradients; training keeps the ranks bit-identical; its
    state (residuals, warm-start Q) is in the optimizer's state_dict."""
    from hvdp.reduce.lowrank import seeded_init
    from reduction_bounds import reference_powersgd
    model, x, y = model_and_data(seed=5)
    twin = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.powersgd.configure(rank=rank),
                                   policy=hvd.CompressionPolicy(min_elements=1))
    sl = my_slice(len(x))
    torch.nn.functional.cross_entropy(twin(x[sl]), y[sl]).backward()
    loss0 = torch.nn.functional.cross_entropy(model(x[sl]), y[sl])
    loss0.backward()
    loss0 = float(loss0)
    opt.synchronize()
    params, codec = list(model.parameters()), opt.engine.settings.codec
    local = [q.grad.reshape(-1) for q in twin.parameters()]
    worst = 0.0
    for b, idx in enumerate(opt.engine.plan.buckets):
        everyone = hvd.allgather(torch.cat([local[i] for i in idx]).reshape(1, -1), name=f"psgd.{b}")
        shapes = [tuple(params[i].shape) for i in idx]
        dims = [codec.matrix(s)[1:] for s in shapes if codec.matrix(s)]
        want = reference_powersgd(codec, shapes, [e.numpy() for e in everyone],
                                  seeded_init(codec.seed)(f"b{b}", dims))
        off = 0
        for i, s in zip(idx, shapes):  # each tensor against its own largest value
            k = params[i].numel()
            got, ref = params[i].grad.reshape(-1).double().numpy(), want[off:off + k]
            worst = max(worst, float(abs(got - ref).max()) / float(abs(ref).max()))
            exact = everyone[:, off:off + k].double().mean(0).numpy()
            if codec.matrix(s):  # low rank indeed: not the exact average
                assert float(abs(got - exact).max()) > 1e-3 * float(abs(exact).max()), s
            off += k
    assert worst <= 1e-5, worst  # float32 against float64 (seen: 2e-7)
    assert opt.compression_stats()["last_step"]["powersgd"]["ratio"] < 0.5
    with opt.skip_synchronize():
        opt.step()
    train(model, opt, x[sl], y[sl], steps)
    ranks_identical(model)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x[sl]), y[sl])
    assert float(loss) < loss0, (float(loss), loss0)
    sd = opt.state_dict()["hvdp"]["reducer"]
    assert sd["worker"] and sd["server"] and sd["codec"] == str(codec)
    # the state (residuals, warm-start Qs) through state_dict: the next step is the same bits
    saved = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                    named_parameters=model2.named_parameters(), compression=codec,
                                    policy=hvd.CompressionPolicy(min_elements=1))
    model3 = copy.deepcopy(model)  # without the state: another step
    opt3 = hvd.DistributedOptimizer(torch.optim.SGD(model3.parameters(), lr=0.1),
                                    named_parameters=model3.named_parameters(), compression=codec,
                                    policy=hvd.CompressionPolicy(min_elements=1))
    opt2.load_state_dict(saved)
    for m, o in ((model, opt), (model2, opt2), (model3, opt3)):
        train(m, o, x[sl], y[sl], 1)
    params_close(model, model2, tol=0.0)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), model3.parameters()))
    print(f"  powersgd rank {rank}: max rel err vs reference {worst:.3g}, loss {loss0:.4f} -> "
          f"{float(loss):.4f}", flush=True)


def check_state_dict_carries_error_feedback():
    model, x, y = model_and_data(seed=3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="int8",
                                   policy=hvd.CompressionPolicy(min_elements=1))
    sl = my_slice(len(x))
    train(model, opt, x[sl], y[sl], 3)
    sd = copy.deepcopy(opt.state_dict())
    res = sd["hvdp"]["reducer"]["worker"]
    assert res and all(torch.count_nonzero(v) > 0 for v in res.values())
    model2 = copy.deepcopy(model)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                    named_parameters=model2.named_parameters(), compression="int8",
                                    policy=hvd.CompressionPolicy(min_elements=1))
    opt2.load_state_dict(sd)
    for k, v in res.items():
        assert torch.equal(opt2.engine.reducer.worker_residual[k], v)
    train(model, opt, x[sl], y[sl], 1)
    train(model2, opt2, x[sl], y[sl], 1)
    params_close(model, model2, tol=0.0)  # the same residuals give the same next step
    # without the residuals the next step differs: the state matters
    model3 = copy.deepcopy(model2)
    opt3 = hvd.DistributedOptimizer(torch.optim.SGD(model3.parameters(), lr=0.1),
                                    named_parameters=model3.named_parameters(), compression="int8",
                                    policy=hvd.CompressionPolicy(min_elements=1))
    train(model2, opt2, x[sl], y[sl], 1)
    train(model3, opt3, x[sl], y[sl], 1)
    assert any(not torch.equal(p, q) for p, q in zip(model2.parameters(), model3.parameters()))


def check_nonfinite_agreed():
    for name in ["none", "int8", "bf16"]:
        model, x, y = model_and_data()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=name,
                                       policy=hvd.CompressionPolicy(min_elements=1))
        sl = my_slice(len(x))
        if hvd.rank() == hvd.size() - 1:  # an overflow in one worker's backward
            def poison(g):
                g = g.clone()
                g[3, 4] = float("inf")
                return g
            model[0].weight.register_hook(poison)
        torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.synchronize()
        g = model[0].weight.grad
        assert not torch.isfinite(g[3, 4]), name
        assert torch.isfinite(g).sum() == g.numel() - 1, name
        flags = hvd.allgather(torch.tensor([[int(torch.isfinite(p.grad).all()) for p in model.parameters()]]),
                              name=f"nf.{name}")
        assert torch.equal(flags[0], flags[-1]), name


def check_errors():
    model, _, _ = model_and_data()
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression="int3")
    except ValueError as e:
        assert "valid names" in str(e) and "int8" in str(e)
    else:
        raise AssertionError("unknown codec accepted")
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("a", model[0].weight)])
    except ValueError as e:
        assert "not in it" in str(e)
    else:
        raise AssertionError("partial named_parameters accepted")


def check_warmup():
    model, x, y = model_and_data(seed=11)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="int8",
                                   policy=hvd.CompressionPolicy(min_elements=1, warmup_steps=2))
    sl = my_slice(len(x))
    for step in range(3):
        twin = copy.deepcopy(model)  # the local gradient, apart from the one being reduced in place
        torch.nn.functional.cross_entropy(twin(x[sl]), y[sl]).backward()
        local = [p.grad for p in twin.parameters()]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.step()
        codecs_used = set(opt.compression_stats()["last_step"]) - {"all"}
        exact = [hvd.allgather(g.reshape(1, -1), name=f"wu.{step}.{i}").double().mean(0)
                 for i, g in enumerate(local)]
        err = max((p.grad.reshape(-1).double() - e).abs().max().item()
                  for p, e in zip(model.parameters(), exact))
        if step < 2:
            assert codecs_used == {"none"} and err <= 1e-6, (step, codecs_used, err)
        else:
            assert codecs_used == {"int8"} and 0 < err < 1e-2, (step, codecs_used, err)


class SparseNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 40, sparse=True)
        self.out = torch.nn.Linear(40, 3)
        self.unused = torch.nn.Linear(40, 40)     # in no rank's graph: grad None, as plain torch
        self.empty = torch.nn.Parameter(torch.zeros(0))

    def forward(self, idx):
        return self.out(self.emb(idx).mean(1))


def check_sparse_unused_empty():
    g = torch.Generator().manual_seed(hvd.rank())
    idx, y = torch.randint(0, 50, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)
    for compression, dense in [("none", False), ("int8", True), ("int8", False)]:
        model = SparseNet()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=compression, sparse_as_dense=dense,
                                       policy=hvd.CompressionPolicy(min_elements=1))
        ref = SparseNet()
        torch.nn.functional.cross_entropy(ref(idx), y).backward()
        local = ref.emb.weight.grad.to_dense()
        exact = hvd.allgather(local.unsqueeze(0), name=f"sp.{compression}.{dense}").double().mean(0)
        torch.nn.functional.cross_entropy(model(idx), y).backward()
        if compression == "int8" and not dense:
            try:
                opt.synchronize()
            except ValueError as e:
                assert "sparse_as_dense=True" in str(e) and "emb.weight" in str(e), e
                continue
            raise AssertionError("sparse gradient silently compressed")
        opt.synchronize()
        # handed back sparse, as Horovod does: an optimizer that needs it (SparseAdam) steps
        assert model.emb.weight.grad.is_sparse, (compression, dense)
        if dense:
            torch.optim.SparseAdam([model.emb.weight], lr=0.01).step()
        got = model.emb.weight.grad.to_dense().double()
        # int8: blocks span every tensor of the bucket; the largest |gradient| of any tensor on
        # any rank bounds each block's step (derived bound as in check_codecs)
        local_max = max(q.grad.to_dense().abs().max().item() for q in ref.parameters()
                        if q.grad is not None and q.grad.numel())
        gmax = hvd.allgather(torch.tensor([local_max]), name=f"spm.{compression}.{dense}").max().item()
        tol = 1e-6 if compression == "none" else gmax / 254 + (gmax + gmax / 254) / 254
        assert (got - exact).abs().max().item() <= tol, (compression, dense)
        assert model.unused.weight.grad is None and model.empty.grad is None


def check_restore_after_failed_step():
    """As elastic.run does after a failure mid-backward: restore() must drop what the gradient
    hooks had already launched, or the next zero_grad() would refuse to run."""
    import time
    model, x, y = model_and_data(seed=8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression="int8",
                                   policy=hvd.CompressionPolicy(min_elements=1))
    state = hvd.elastic.TorchState(model=model, optimizer=opt)
    sl = my_slice(len(x))
    torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()  # reductions launched
    try:
        opt.zero_grad()
    except AssertionError:
        pass
    else:
        raise AssertionError("zero_grad() with reductions in flight was accepted")
    time.sleep(0.5)  # (the abandoned collectives finish; a real reset shuts Horovod down instead)
    state.restore()
    train(model, opt, x[sl], y[sl], 2)
    ranks_identical(model)


def check_horovod_options():
    """groups (a count and explicit lists), op=Sum, gradient_predivide_factor, Adasum."""
    x, y = model_and_data()[1:]
    sl = my_slice(len(x))
    for kw, scale in [({"groups": 2}, 1.0), ({"groups": "lists"}, 1.0), ({"op": hvd.Sum}, hvd.size()),
                      ({"gradient_predivide_factor": 2.0}, 1.0)]:
        model = model_and_data()[0]
        twin = copy.deepcopy(model)
        if kw.get("groups") == "lists":
            ps = list(model.parameters())
            kw = {"groups": [ps[:2], ps[2:]]}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **kw)
        torch.nn.functional.cross_entropy(twin(x[sl]), y[sl]).backward()
        torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
        opt.synchronize()
        for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
            exact = hvd.allgather(q.grad.reshape(1, -1), name=f"opt.{i}.{len(str(kw))}").double().mean(0)
            assert (p.grad.reshape(-1).double() - scale * exact).abs().max() <= 1e-6, kw
    if hvd.mpi_enabled():  # Horovod implements Adasum over MPI only
        model = model_and_data()[0]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), op=hvd.Adasum)
        train(model, opt, x[sl], y[sl], 1)  # Horovod's own Adasum optimizer, one step
        ranks_identical(model)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                 compression="int8")
    except ValueError as e:
        assert "Adasum" in str(e)
    else:
        raise AssertionError("Adasum with int8 accepted")


CHECKS = {
    "freed": lambda: __import__("torch_lifetime_checks").check_dropped_optimizers_are_freed(),
    "grad_average": check_grad_average,
    "two_equal_one": check_two_workers_equal_one,
    "bpps": lambda: check_two_workers_equal_one(bpps=3),
    "broadcast": check_broadcast,
    "amp": check_amp_gradscaler,
    "codecs": check_codecs,
    "powersgd": check_powersgd,
    "powersgd_ddp": lambda: __import__("powersgd_ddp_checks").check_powersgd_matches_ddp_hook(),
    "state": check_state_dict_carries_error_feedback,
    "nonfinite": check_nonfinite_agreed,
    "errors": check_errors,
    "warmup": check_warmup,
    "sparse_unused_empty": check_sparse_unused_empty,
    "checkpoint": lambda: __import__("torch_checkpoint_checks").check_checkpoint_resume(),
    "save_for_other_size": lambda: __import__("torch_checkpoint_checks").check_save_for_other_size(),
    "resume_other_size": lambda: __import__("torch_checkpoint_checks").check_resume_other_size(),
    "disk": lambda: __import__("torch_checkpoint_checks").check_full_or_read_only_disk(),
    "elastic_restore": check_restore_after_failed_step,
    "horovod_options": check_horovod_options,
    "overlap": lambda: __import__("overlap_checks").check_overlap(),
    "sleeping_wait": lambda: __import__("torch_wait_checks").check_waits_sleep(),
}

if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for name in sys.argv[1:] or [n for n in CHECKS if n not in ("resume_other_size", "disk")]:
        CHECKS[name]()
        print(f"CHECK {name} OK rank={hvd.rank()}", flush=True)
