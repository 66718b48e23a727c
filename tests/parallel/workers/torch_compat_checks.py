"""hvdp.torch against plain Horovod in the same job (issue 27's compatibility suite): each call
of a Horovod script on hvdp.torch and on horovod.torch, the results compared — the API surface,
module-level collectives with and without compression=, the compressor contract, each optimizer
argument, sparse gradients, broadcasts, the elastic sampler, join. Prints 'CHECK <name> OK
rank=<r>' (tests/parallel/test_horovod_compat.py)."""
import inspect
import os
import sys

import horovod.torch as H
import torch

import hvdp.torch as hvd

# Horovod 0.28.1's module-level reductions: the ones that take compression= and the async ones,
# which do not (allreduce_async(t, compression=...) is Horovod's own TypeError)
WITH_COMPRESSION = ["allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter"]
ASYNC = ["allreduce_async", "allreduce_async_", "allreduce_", "grouped_allreduce_async",
         "grouped_allreduce_async_", "grouped_allreduce_", "reducescatter_async", "grouped_reducescatter_async"]


def check_module_collectives():
    """hvd.allreduce / grouped_allreduce / reducescatter / grouped_reducescatter with
    compression=hvd.Compression.fp16 or .none give Horovod's bits; the signatures are Horovod's;
    a two-phase codec is a clear error on every rank. (Not the autograd path: Horovod's backward
    allreduce is unnamed, and earlier checks of the job, uneven joins, leave the ranks' counters
    of unnamed ops apart, so it would hang here.)"""
    for name in WITH_COMPRESSION + ASYNC:
        assert inspect.signature(getattr(hvd, name)) == inspect.signature(getattr(H, name)), name
    t = torch.randn(1000, generator=torch.Generator().manual_seed(hvd.rank())) * 100
    for ours, theirs in ((hvd.Compression.fp16, H.Compression.fp16), (hvd.Compression.none, H.Compression.none)):
        tag = f"mc.{ours.name}"
        pairs = [(hvd.allreduce(t, name=f"{tag}.a", compression=ours),
                  H.allreduce(t, name=f"{tag}.ha", compression=theirs)),
                 (hvd.allreduce(t, name=f"{tag}.s", compression=ours, op=hvd.Sum),
                  H.allreduce(t, name=f"{tag}.hs", compression=theirs, op=H.Sum)),
                 *zip(hvd.grouped_allreduce([t, 2 * t], name=f"{tag}.g", compression=ours),
                      H.grouped_allreduce([t, 2 * t], name=f"{tag}.hg", compression=theirs)),
                 (hvd.reducescatter(t, name=f"{tag}.r", compression=ours),
                  H.reducescatter(t, name=f"{tag}.hr", compression=theirs)),
                 *zip(hvd.grouped_reducescatter([t, 3 * t], name=f"{tag}.gr", compression=ours),
                      H.grouped_reducescatter([t, 3 * t], name=f"{tag}.hgr", compression=theirs))]
        for i, (a, b) in enumerate(pairs):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (tag, i)
    exact = hvd.allreduce(t, name="mc.exact")
    half = hvd.allreduce(t, name="mc.half", compression=hvd.Compression.fp16)
    assert not torch.equal(exact, half), "fp16 did not reach the wire"
    assert float((exact - half).abs().max()) <= 2 ** -10 * float(t.abs().max()) * 2
    for name in ("int8", "topk", "bf16"):
        try:
            hvd.allreduce(t, name=f"mc.{name}", compression=getattr(hvd.Compression, name))
        except ValueError as e:
            assert "use hvd.Compression.fp16 or hvd.Compression.none" in str(e), e
        else:
            raise AssertionError(f"hvd.allreduce(compression=hvd.Compression.{name}) ran")
    for mod in (hvd, H):  # neither takes compression= on the async calls (Horovod 0.28.1)
        try:
            mod.allreduce_async(t, name="mc.async.bad", compression=mod.Compression.fp16)
        except TypeError:
            pass
        else:
            raise AssertionError(f"{mod.__name__}.allreduce_async took compression=")
    assert torch.equal(hvd.synchronize(hvd.allreduce_async(t, name="mc.async")), exact)


def check_elastic_sampler():
    """Horovod's elastic example: hvd.elastic.ElasticSampler(dataset) feeding a DataLoader, kept in
    a TorchState, record_batch(batch_idx, batch_size), commit, restore; the same indices as
    Horovod's own sampler on every rank."""
    from horovod.torch.elastic import ElasticSampler as HorovodSampler
    data = torch.utils.data.TensorDataset(torch.arange(101).float())
    ours, theirs = hvd.elastic.ElasticSampler(data), HorovodSampler(data)
    assert list(ours) == list(theirs) and len(ours) == len(theirs) == 51
    model = torch.nn.Linear(1, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, train_sampler=ours, epoch=0, batch=0)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=ours)
    seen = []
    for batch_idx, (x,) in enumerate(loader):
        seen.append(x.long())
        ours.record_batch(batch_idx, 4)
        theirs.record_batch(batch_idx, 4)
        if batch_idx == 2:
            state.commit()
        if batch_idx == 4:
            break
    assert torch.equal(torch.cat(seen), torch.tensor(list(HorovodSampler(data))[:20]))
    state.restore()  # back to the commit after 3 batches: 3 * 4 * size samples done
    assert ours.state_dict()["processed"] == 12 * hvd.size()
    theirs.load_state_dict(dict(theirs.state_dict(), processed_num=12 * hvd.size()))
    assert list(ours) == list(theirs) and len(ours) == len(theirs)
    state.sync()
    ours.set_epoch(1)
    theirs.set_epoch(1)
    assert list(ours) == list(theirs)


# --- pairs: the same script on hvdp.torch and on horovod.torch, results compared ----------------
def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _train(mod, kw, steps=3, bpps=1, tag=""):
    """A Horovod-style loop on ``mod`` (hvdp.torch or horovod.torch): rank-dependent batches."""
    model = _model()
    opt = mod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=[(tag + n, p) for n, p in model.named_parameters()],
                                   backward_passes_per_step=bpps, **kw(model))
    g = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(bpps):
            x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


OPTIMIZER_ARGS = {  # Horovod's DistributedOptimizer arguments, each alone
    "defaults": lambda m, mod: {},
    "bpps2": lambda m, mod: {},  # backward_passes_per_step=2 (below)
    "op_sum": lambda m, mod: {"op": mod.Sum},
    "predivide2": lambda m, mod: {"gradient_predivide_factor": 2.0},
    "num_groups2": lambda m, mod: {"num_groups": 2},
    "groups_list": lambda m, mod: {"groups": [[m[0].weight, m[2].weight]]},
    "fp16": lambda m, mod: {"compression": mod.Compression.fp16},
}


def check_optimizer_args():
    """Each of Horovod's optimizer arguments gives the parameters plain Horovod gives (float32
    average of 2 ranks: the same bits, allowed a few ulps for a reordered sum)."""
    for name, kw in OPTIMIZER_ARGS.items():
        bpps = 2 if name == "bpps2" else 1
        ours = _train(hvd, lambda m: kw(m, hvd), bpps=bpps, tag=f"oa.{name}.")
        theirs = _train(H, lambda m: kw(m, H), bpps=bpps, tag=f"oah.{name}.")
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def check_sparse_adam():
    """sparse_as_dense=True with torch.optim.SparseAdam (sparse embedding gradients): Horovod
    hands the reduced gradient back sparse; so does hvdp, and the parameters match Horovod's."""
    out = []
    for mod, tag in ((hvd, "sa"), (H, "sah")):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(50, 8, sparse=True)
        opt = mod.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.01),
                                       named_parameters=[(f"{tag}.w", emb.weight)], sparse_as_dense=True)
        for step in range(3):
            opt.zero_grad()
            idx = torch.tensor([hvd.rank(), 10 + step, 20 + hvd.rank() * 3])
            emb(idx).pow(2).sum().backward()
            opt.step()
            assert emb.weight.grad.is_sparse, f"{mod.__name__}: a dense gradient reached SparseAdam"
        out.append(emb.weight.detach().clone())
    torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-7)


def check_broadcasts():
    """broadcast_parameters, broadcast_optimizer_state, broadcast_object, allgather_object:
    rank 0's values everywhere, as Horovod's."""
    got = []
    for mod, tag in ((hvd, "bc"), (H, "bch")):
        model = _model(seed=hvd.rank())          # the ranks start apart
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 12)).sum().backward()
        opt.step()                               # a momentum buffer, rank-dependent
        mod.broadcast_parameters(model.state_dict(), root_rank=0)
        mod.broadcast_optimizer_state(opt, root_rank=0)
        obj = mod.broadcast_object({"rank": hvd.rank(), "t": torch.arange(3) * hvd.rank()}, 0, name=f"{tag}.o")
        every = mod.allgather_object((hvd.rank(), "x" * hvd.rank()), name=f"{tag}.g")
        got.append(([p.detach().clone() for p in model.parameters()],
                    [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()], obj, every))
    (pa, ma, oa, ea), (pb, mb, ob, eb) = got
    for a, b in zip(pa + ma, pb + mb):
        assert torch.equal(a, b)
    assert oa["rank"] == ob["rank"] == 0 and torch.equal(oa["t"], ob["t"]) and ea == eb


def check_compressor_contract():
    """hvd.Compression.fp16.compress / decompress: Horovod's (tensor, ctx) contract and bits."""
    t = torch.randn(33, generator=torch.Generator().manual_seed(5))
    (a, ca), (b, cb) = hvd.Compression.fp16.compress(t), H.Compression.fp16.compress(t)
    assert a.dtype == b.dtype == torch.float16 and torch.equal(a, b) and ca == cb
    assert torch.equal(hvd.Compression.fp16.decompress(a, ca), H.Compression.fp16.decompress(b, cb))
    (a, ca), (b, cb) = hvd.Compression.none.compress(t), H.Compression.none.compress(t)
    assert torch.equal(a, b) and ca == cb


def check_join_plain():
    """Uneven shards (rank 1 has one batch more), compression none, hvd.join() at the end: the
    same return value (the last rank to join) and, on that rank, the same parameters as plain
    Horovod. On purpose different: hvdp's join then gives every rank that rank's model (Horovod
    leaves the ranks apart; docs/compatibility.md)."""
    import gc
    gc.collect()  # join touches every live hvdp optimizer: the earlier checks' are gone
    got = []
    for mod, tag in ((hvd, "jp"), (H, "jph")):
        model = _model()
        opt = mod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=[(tag + n, p) for n, p in model.named_parameters()])
        g = torch.Generator().manual_seed(200 + hvd.rank())
        for _ in range(2 + hvd.rank()):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.randn(8, 12, generator=g)),
                                              torch.randint(0, 3, (8,), generator=g)).backward()
            opt.step()
        last = mod.join()
        got.append((last, [p.detach().clone() for p in model.parameters()]))
        del opt
        gc.collect()
    (la, pa), (lb, pb) = got
    assert la == lb == hvd.size() - 1, (la, lb)
    every = hvd.allgather_object([p.numpy() for p in pa], name="jp.every")
    for a, b in zip(every[0], every[-1]):
        assert (a == b).all(), "hvdp's join left the ranks apart"
    if hvd.rank() == la:
        for a, b in zip(pa, pb):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def check_api_surface():
    """Every public name of horovod.torch (and of its elastic module's classes) is in hvdp.torch,
    and every function takes Horovod's parameters in Horovod's order (hvdp may add keywords)."""
    from horovod.torch import elastic as HE
    missing = [n for n in dir(H) if not n.startswith("_") and not hasattr(hvd, n)]
    missing += [f"elastic.{n}" for n in ("ElasticSampler", "TorchState", "run", "State", "ObjectState")
                if hasattr(HE, n) and not hasattr(hvd.elastic, n)]
    assert not missing, missing
    for n in dir(H):
        f = getattr(H, n)
        if n.startswith("_") or not inspect.isfunction(f) or n == "init":  # Horovod's init: (*args, **kwargs)
            continue
        theirs = list(inspect.signature(f).parameters)
        ours = list(inspect.signature(getattr(hvd, n)).parameters)
        assert ours[:len(theirs)] == theirs, (n, theirs, ours)


CHECKS = {
    "api_surface": check_api_surface,
    "module_collectives": check_module_collectives,
    "compressor_contract": check_compressor_contract,
    "optimizer_args": check_optimizer_args,
    "sparse_adam": check_sparse_adam,
    "broadcasts": check_broadcasts,
    "elastic_sampler": check_elastic_sampler,
    "join_plain": check_join_plain,
}

if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from case_report import run_named_checks
    run_named_checks(CHECKS, sys.argv[1:], hvd.rank)
