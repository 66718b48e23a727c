"""hvdp.lightning on one worker (no processes): the reduce-op table, the refusals that need no
second rank, the residuals' way in and out of a checkpoint, and an hvd.DistributedOptimizer seen
through Lightning's LightningOptimizer (a subclass of its class: super() must not recurse)."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("horovod.torch")
pytest.importorskip("lightning")

import hvdp.torch as hvd  # noqa: E402
from lightning.fabric.utilities.types import ReduceOp  # noqa: E402

from hvdp.lightning import collectives  # noqa: E402
from hvdp.lightning.checkpoint import KEY, gather_residuals, own_residuals  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_worker():
    # Horovod stays up until the test process exits: a Horovod built with MPI cannot init again
    # after a shutdown in the same process (MPI_Finalize is final; Open MPI then aborts the whole
    # pytest run with exit status 1 and no summary, as a CI run did after this module's shutdown)
    hvd.init()


@pytest.mark.parametrize("op, want", [(None, "Average"), ("mean", "Average"), ("avg", "Average"), ("SUM", "Sum"),
                                      (ReduceOp.SUM, "Sum"), (ReduceOp.MAX, "Max"), (ReduceOp.MIN, "Min"),
                                      (ReduceOp.AVG, "Average"), ("product", "Product")])
def test_reduce_ops(op, want):
    assert collectives.op_of(op) is getattr(hvd, want)


def test_unknown_op_and_groups_are_refused():
    with pytest.raises(ValueError, match="unsupported reduce_op 'median'"):
        collectives.op_of("median")
    with pytest.raises(ValueError, match="process_set"):
        collectives.reduce(torch.ones(1), group=object())


def test_one_worker_collectives():
    assert collectives.reduce(torch.tensor([3]), reduce_op="mean").dtype == torch.float32  # a mean is not an int
    assert collectives.reduce(torch.tensor([2.0], dtype=torch.bfloat16), reduce_op="sum").dtype == torch.bfloat16
    assert collectives.reduce("not a tensor") == "not a tensor"
    assert collectives.all_gather(torch.tensor([1.0, 2.0])).shape == (1, 2)
    assert collectives.broadcast({"a": 1}) == {"a": 1}


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    return model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), compression="int8",
                                           policy=hvd.CompressionPolicy(min_elements=1))


def test_residuals_in_and_out_of_the_optimizer_state():
    model, opt = model_and_opt()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    saved = gather_residuals(opt.state_dict())
    assert "hvdp" not in saved and len(saved[KEY]) == 1
    back = own_residuals(saved, 0)
    assert KEY not in back and "hvdp" in back
    opt.load_state_dict(back)
    assert own_residuals({"state": {}}, 0) == {"state": {}}  # a state without hvdp's: unchanged


def test_lightning_optimizer_around_a_distributed_optimizer():
    """LightningOptimizer's class derives from the optimizer's; its zero_grad (inherited) recursed
    without end while hvdp.torch's methods called super(self.__class__, self)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer
    model, opt = model_and_opt()
    wrapped = LightningOptimizer(opt)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    wrapped.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert "hvdp" in type(wrapped).state_dict(wrapped)


def test_two_optimizers_sharing_a_parameter_are_refused():
    from hvdp.lightning.optimizers import wrap_optimizers
    model = torch.nn.Linear(3, 1)
    a, b = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD([model.weight], lr=0.1)
    with pytest.raises(ValueError, match="weight is in optimizers 0 and 1"):
        wrap_optimizers(model, [a, b], [], 1, {"compression": "none"})


def test_a_second_trainer_over_the_same_module():
    """The first Trainer's optimizer stops reducing when its fit ends (its hooks would otherwise
    count the second run's backward passes too and fail it)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from hvdp.lightning import HorovodStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
    trainers = [pl.Trainer(max_epochs=1, strategy=HorovodStrategy(compression="int8"), logger=False,
                           enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
                for _ in range(2)]
    for t in trainers:  # both stay alive, so the first one's optimizer does too
        t.fit(module, data)
    assert trainers[1].global_step == 4
