"""Checks of hvdp.lightning.HorovodStrategy under real workers: each rank runs the named checks in
order and prints 'CHECK <name> OK rank=<r>'; a failed check raises, which fails the job.

The reference for each Trainer run is the same model, data and sampler trained by a plain loop
over hvdp.torch (``hvd.DistributedOptimizer``), as a Horovod user writes it."""
import os
import sys
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hvdp.torch as hvd
from hvdp.lightning import HorovodFabricStrategy, HorovodStrategy

N, BATCH, EPOCHS = 64, 8, 2
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LightningModule.*sync_dist.*")


def dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, 20, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))


class Classifier(pl.LightningModule):
    def __init__(self, seed, manual=False, clip=None):
        super().__init__()
        self.net = net(seed)
        self.automatic_optimization = not manual
        self.clip = clip

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("rank_mean", float(self.global_rank) + 1.0, sync_dist=True)
        self.log("rank_max", float(self.global_rank) + 1.0, sync_dist=True, reduce_fx="max")
        self.log("rank_sum", torch.tensor(float(self.global_rank) + 1.0), sync_dist=True, reduce_fx="sum")

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def trainer(strategy, epochs=EPOCHS, **kw):
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(max_epochs=epochs, strategy=strategy, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def loader():
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True)


def plain(compression, epochs=EPOCHS, accumulate=1, autocast=False, policy=None, schedule=True, outer=None):
    """The same training by hand: rank 0's weights, Lightning's sampler, its scheduler step per epoch."""
    model = net(0)
    ds = dataset()
    sampler = DistributedSampler(ds, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    named = [("net." + n, p) for n, p in model.named_parameters()]
    if outer:
        opt = hvd.OuterOptimizer(base, named_parameters=named, compression=compression, policy=policy, **outer)
    else:
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compression,
                                       backward_passes_per_step=accumulate, policy=policy)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = list(DataLoader(ds, batch_size=BATCH, sampler=sampler))
        for i, (x, y) in enumerate(batches):
            if i % accumulate == 0:
                opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                opt.step()
        if schedule:
            sched.step()
    return model


def max_diff(a, b):
    return max((p.detach() - q.detach()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def same_on_ranks(model, tag):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather_object(flat, name=f"lt.same.{tag}")
    assert all(torch.equal(every[0], f) for f in every), f"{tag}: ranks differ"


def fit(compression="none", epochs=EPOCHS, seed=None, **kw):
    """A Classifier whose weights differ per rank until the strategy broadcasts rank 0's."""
    lm = Classifier(hvd.rank() if seed is None else seed, manual=kw.pop("manual", False))
    t = trainer(HorovodStrategy(compression=compression, **kw.pop("strategy", {})), epochs=epochs, **kw)
    t.fit(lm, loader())
    return lm, t


def check_same_as_plain_none():
    lm, t = fit("none")
    ref = plain("none")
    same_on_ranks(lm.net, "none")
    err = max_diff(lm.net, ref)
    assert err <= 1e-6, f"Lightning vs plain loop (none): {err:.3g}"
    assert isinstance(t.train_dataloader.sampler, DistributedSampler) and t.train_dataloader.sampler.num_replicas == 2


def check_same_as_plain_int8():
    lm, _ = fit("int8", strategy={"policy": hvd.CompressionPolicy(min_elements=1)})
    ref8 = plain("int8", policy=hvd.CompressionPolicy(min_elements=1))
    ref = plain("none")
    same_on_ranks(lm.net, "int8")
    err8, err = max_diff(lm.net, ref8), max_diff(lm.net, ref)
    assert err8 <= 1e-6, f"Lightning vs plain loop (int8): {err8:.3g}"
    # int8 with error feedback: each step's averaged gradient within 1/127 of its block's largest
    # |value|; after 16 steps of lr <= 0.1 the weights stay within 1e-2 of float32's training
    assert 0 < err <= 1e-2, f"Lightning int8 vs plain none: {err:.3g} (0: the codec did not run)"
    print(f"int8 vs none max |diff| {err:.3g} rank={hvd.rank()}")


def check_accumulate():
    lm, _ = fit("none", accumulate_grad_batches=3)  # 4 batches per epoch: one step of 3, one of 1
    err = max_diff(lm.net, plain("none", accumulate=3))
    assert err <= 1e-6, f"accumulate_grad_batches=3 vs backward_passes_per_step=3: {err:.3g}"


def check_bf16_mixed():
    lm, _ = fit("none", precision="bf16-mixed")
    err = max_diff(lm.net, plain("none", autocast=True))
    assert err <= 1e-6, f"bf16-mixed vs autocast loop: {err:.3g}"


def check_outer():
    """sync_every=3 (DiLoCo's outer Nesterov SGD, int8 pseudo-gradients): hvd.OuterOptimizer's loop;
    a checkpoint inside an interval resumes bit for bit."""
    outer = {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
    policy = hvd.CompressionPolicy(min_elements=1)
    lm, t = fit("int8", strategy=dict(outer, policy=policy))
    assert t.strategy.optimizers[0].compression_stats()["sent_per_inner_step"] > 0
    err = max_diff(lm.net, plain("int8", policy=policy, outer=outer))
    assert err <= 1e-6, f"Lightning outer steps vs hvd.OuterOptimizer loop: {err:.3g}"
    # saved after epoch 1 (step 4: inside the second interval, ranks' local weights differ), resumed
    folder = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvdp-lo-") if hvd.rank() == 0 else None,
                                  root_rank=0, name="lo.dir")
    _, t1 = fit("int8", epochs=1, strategy=dict(outer, policy=policy))
    t1.save_checkpoint(os.path.join(folder, "one.ckpt"))
    resumed = Classifier(hvd.rank() + 7)
    trainer(HorovodStrategy(compression="int8", policy=policy, **outer)).fit(
        resumed, loader(), ckpt_path=os.path.join(folder, "one.ckpt"))
    err = max_diff(resumed.net, lm.net)
    assert err == 0.0, f"outer steps resumed inside an interval vs uninterrupted: {err:.3g}"


def check_outer_warmup():
    """sync_every=3 after 3 synchronous warm-up steps, the warm-up's gradients through int8 and
    float32: Lightning hands the step a closure (forward and backward run inside ``step``), and the
    warm-up must average the gradients that closure made, as the plain loop's."""
    policy = hvd.CompressionPolicy(min_elements=1)
    for warm in ("int8", "none"):
        outer = {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "warmup_steps": 3,
                 "warmup_compression": warm}
        lm, t = fit("int8", strategy=dict(outer, policy=policy))
        # 8 steps: the run ends inside an interval, so the global parameters are the ones all share
        glob = torch.cat([g.reshape(-1) for g in t.strategy.optimizers[0].outer.globals])
        every = hvd.allgather_object(glob, name=f"lt.outer.warm.{warm}")
        assert torch.equal(every[0], every[1]), f"warm-up {warm}: the ranks' global parameters differ"
        err = max_diff(lm.net, plain("int8", policy=policy, outer=outer))
        assert err <= 1e-6, f"Lightning outer steps with a {warm} warm-up vs hvd.OuterOptimizer loop: {err:.3g}"


def check_manual():
    lm, _ = fit("none", manual=True)
    # manual optimization: Lightning steps no scheduler, so the loop keeps its learning rate too
    err = max_diff(lm.net, plain("none", schedule=False))
    assert err <= 1e-6, f"manual optimization vs plain loop: {err:.3g}"


def tensors(obj):
    """The tensors inside nested dicts / lists, in order."""
    if torch.is_tensor(obj):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return [t for x in items for t in tensors(x)]


def check_checkpoint_resume():
    """int8 (error-feedback residuals differ per rank): 1 epoch, save, resume to 2 = 2 uninterrupted."""
    folder = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvdp-lt-") if hvd.rank() == 0 else None,
                                  root_rank=0, name="lt.dir")
    path = os.path.join(folder, "one.ckpt")
    policy = {"policy": hvd.CompressionPolicy(min_elements=1)}
    _, t1 = fit("int8", epochs=1, strategy=policy)
    t1.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    per_rank = saved["optimizer_states"][0]["hvdp_per_rank"]
    mine, other = tensors(per_rank[0]), tensors(per_rank[1])
    assert len(per_rank) == 2 and mine and any(not torch.equal(a, b) for a, b in zip(mine, other)), \
        "each rank's residuals expected in the file"
    resumed = Classifier(hvd.rank() + 7)
    trainer(HorovodStrategy(compression="int8", **policy)).fit(resumed, loader(), ckpt_path=path)
    whole, _ = fit("int8", strategy=policy)
    same_on_ranks(resumed.net, "resumed")
    err = max_diff(resumed.net, whole.net)
    assert err == 0.0, f"resumed vs uninterrupted: {err:.3g}"
    # without the residuals the resumed run is not the same: the check can see them
    stripped = dict(saved)
    stripped["optimizer_states"] = [{k: v for k, v in saved["optimizer_states"][0].items() if k != "hvdp_per_rank"}]
    if hvd.rank() == 0:
        torch.save(stripped, os.path.join(folder, "stripped.ckpt"))
    hvd.barrier()
    cut = Classifier(hvd.rank() + 7)
    trainer(HorovodStrategy(compression="int8", **policy)).fit(cut, loader(),
                                                                  ckpt_path=os.path.join(folder, "stripped.ckpt"))
    assert max_diff(cut.net, whole.net) > 0, "residuals made no difference: the check would not see them lost"


def check_metrics():
    lm, t = fit("none", epochs=1, limit_val_batches=2)
    t.validate(lm, DataLoader(dataset(), batch_size=BATCH), verbose=False)
    m = t.callback_metrics
    assert abs(m["rank_mean"].item() - 1.5) < 1e-6, m
    assert abs(m["rank_max"].item() - 2.0) < 1e-6, m
    assert abs(m["rank_sum"].item() - 6.0) < 1e-6, m  # (1 + 2) on each of the 2 batches
    every = hvd.allgather_object({k: v.item() for k, v in m.items()}, name="lt.metrics")
    assert every[0] == every[1], f"metrics differ between ranks: {every}"
    s = t.strategy
    g = s.all_gather(torch.tensor([float(hvd.rank())]))
    assert g.shape == (2, 1) and g.flatten().tolist() == [0.0, 1.0], g
    assert s.broadcast("from-0" if hvd.rank() == 0 else None) == "from-0"
    assert s.reduce_boolean_decision(hvd.rank() == 0, all=False) and not s.reduce_boolean_decision(hvd.rank() == 0)
    assert s.reduce(torch.tensor([hvd.rank()]), reduce_op="mean").item() == 0.5
    s.barrier()
    # a second Trainer over the same module while the first is alive: only its optimizer reduces
    t2 = trainer(HorovodStrategy(compression="int8"), epochs=1)
    t2.fit(lm, loader())
    same_on_ranks(lm.net, "second_fit")


def fabric_run(epochs, first=0, path_in=None, path_out=None, **kw):
    """Fabric's loop: int8 (every tensor compressed), the sampler Fabric inserts, optionally resumed
    from ``path_in`` (at epoch ``first``) and saved to ``path_out`` at the end."""
    from lightning.fabric import Fabric
    fabric = Fabric(strategy=HorovodFabricStrategy(compression="int8", policy=hvd.CompressionPolicy(min_elements=1)),
                    **kw)
    fabric.launch()
    model = net(3 * hvd.rank())  # rank 0: the plain loop's weights; the others differ until the broadcast
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    data = fabric.setup_dataloaders(loader())
    if path_in:
        fabric.load(path_in, {"model": model, "optimizer": opt})
    for _ in range(first):  # Fabric sets the sampler's epoch by counting the loader's iterations
        next(iter(data))
    for epoch in range(first, epochs):
        for x, y in data:
            opt.zero_grad()
            fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
    if path_out:
        fabric.save(path_out, {"model": model, "optimizer": opt})
    return model.module if hasattr(model, "module") else model


def check_fabric():
    """Fabric: the plain loop's training (int8); a save after epoch 1 resumed to 2 = 2 uninterrupted."""
    whole = fabric_run(EPOCHS)
    same_on_ranks(whole, "fabric")
    err = max_diff(whole, plain("int8", policy=hvd.CompressionPolicy(min_elements=1), schedule=False))
    assert err <= 1e-6, f"Fabric vs plain loop (int8): {err:.3g}"
    folder = hvd.broadcast_object(tempfile.mkdtemp(prefix="hvdp-lf-") if hvd.rank() == 0 else None,
                                  root_rank=0, name="lf.dir")
    path = os.path.join(folder, "one.pt")
    fabric_run(1, path_out=path)
    assert len(torch.load(path, weights_only=True)["optimizer"]["hvdp_per_rank"]) == 2
    resumed = fabric_run(EPOCHS, first=1, path_in=path)
    err = max_diff(resumed, whole)
    assert err == 0.0, f"Fabric resumed vs uninterrupted: {err:.3g}"
    from lightning.fabric import Fabric
    assert isinstance(Fabric(strategy="hvdp").strategy, HorovodFabricStrategy)


def expect_refusal(make, words):
    try:
        make()
    except ValueError as e:
        assert all(w in str(e) for w in words), f"message lacks {words}: {e}"
        return
    raise AssertionError(f"not refused: {words}")


class TwoOptimizers(Classifier):
    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


def check_refusals():
    expect_refusal(lambda: trainer(HorovodStrategy(), sync_batchnorm=True).fit(Classifier(0), loader()),
                   ["sync_batchnorm", "hvd.SyncBatchNorm"])
    expect_refusal(lambda: trainer(HorovodStrategy(), devices=2, accelerator="cpu").fit(Classifier(0), loader()),
                   ["devices", "horovodrun -np N"])
    expect_refusal(lambda: trainer(HorovodStrategy()).fit(TwoOptimizers(0, manual=True), loader()),
                   ["manual optimization with 2 optimizers", "allow_manual_multi_optimizer=True"])
    expect_refusal(lambda: trainer(HorovodStrategy(backward_passes_per_step=2), accumulate_grad_batches=3)
                   .fit(Classifier(0), loader()), ["accumulate_grad_batches"])
    assert isinstance(pl.Trainer(strategy="hvdp", logger=False).strategy, HorovodStrategy)


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for name in sys.argv[1:]:
        t0 = time.perf_counter()
        globals()["check_" + name]()
        hvd.barrier()
        print(f"CHECK {name} OK rank={hvd.rank()} ({time.perf_counter() - t0:.1f} s)", flush=True)
