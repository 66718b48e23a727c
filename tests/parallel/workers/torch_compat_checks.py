"""What a Horovod torch script does besides the optimizer (issue 27), against plain Horovod in the
same job: each call on hvdp.torch and on horovod.torch, the results compared (module-level
collectives, the elastic sampler). Run as checks of torch_user_checks.py (its job)."""
import inspect

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
