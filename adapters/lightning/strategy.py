"""``HorovodStrategy``: Lightning's Trainer over hvdp.torch, one process per device, started by
horovodrun / torchrun / srun (Lightning launches nothing)."""
from typing import Any, Callable, Optional

import hvdp.torch as hvd
import lightning.pytorch as pl
import torch
from hvdp.torch.optimizer import is_distributed
from hvdp.torch.outer import is_outer_class
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from . import collectives
from .checkpoint import gather_residuals, own_residuals
from .environment import HorovodEnvironment, ensure_init
from .optimizers import wrap_optimizers


class HorovodStrategy(ParallelStrategy):
    """Data parallelism with hvdp's ``DistributedOptimizer`` for ``lightning.pytorch.Trainer``.

    Launch the script with ``horovodrun -np N`` (or torchrun / srun: ``hvd.init()`` bootstraps);
    leave the Trainer's ``devices`` at its default. The keyword arguments are those of
    ``hvdp.torch.DistributedOptimizer`` (``compression``, ``policy``, ``op``, ``groups``,
    ``sparse_as_dense``, ``gradient_predivide_factor``, ``compile_codecs``, ``hierarchical``,
    ``uneven_inputs``); with ``sync_every=H`` those of ``hvdp.torch.OuterOptimizer`` instead
    (``outer_lr``, ``outer_momentum``, ``nesterov``, ``fragments``, ``delay``, ``mix``,
    ``warmup_steps``, ``warmup_compression``, ``policy``): outer steps, gradients accumulate locally, no per-step
    reduction. ``backward_passes_per_step`` follows the Trainer's
    ``accumulate_grad_batches`` under automatic optimization; under manual optimization give it
    here when ``training_step`` calls ``manual_backward`` several times per ``opt.step()``.

    Example::

        trainer = L.Trainer(max_epochs=5, strategy=HorovodStrategy(compression="int8"),
                            accumulate_grad_batches=2, precision="bf16-mixed")
    """

    strategy_name = "hvdp"

    def __init__(self, compression: Any = "none", backward_passes_per_step: Optional[int] = None,
                 allow_manual_multi_optimizer: bool = False, accelerator=None, checkpoint_io=None,
                 precision_plugin=None, **optimizer_kwargs: Any) -> None:
        ensure_init()
        super().__init__(accelerator=accelerator, cluster_environment=HorovodEnvironment(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._optimizer_kwargs = dict(optimizer_kwargs, compression=compression)
        self._backward_passes = backward_passes_per_step
        self._allow_manual_multi = allow_manual_multi_optimizer

    # --- where this process runs ------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:  # the Trainer asks this of custom strategies (samplers)
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cpu":
            return devices[0]
        return torch.device(devices[0].type, self.local_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup_environment(self) -> None:
        devices = self.parallel_devices or []
        if len(devices) > 1 and devices[0].type == "cpu":
            raise ValueError(f"HorovodStrategy: Trainer(devices={len(devices)}) asks Lightning to start "
                             "processes; with Horovod the launcher starts them, one per device: leave "
                             "devices at its default and run `horovodrun -np N python script.py`")
        if devices and devices[0].type != "cpu" and self.local_rank >= len(devices):
            raise ValueError(f"HorovodStrategy: local rank {self.local_rank} has no device among the Trainer's "
                             f"{len(devices)}; start at most {len(devices)} processes per host")
        if self._layer_sync is not None:
            raise ValueError("HorovodStrategy: Trainer(sync_batchnorm=True) needs torch.distributed; use "
                             "Horovod's hvd.SyncBatchNorm (hvdp.torch) in the LightningModule instead "
                             "and leave sync_batchnorm off")
        rank_zero_only.rank = self.global_rank
        super().setup_environment()

    # --- set-up: optimizers wrapped, rank 0's state everywhere --------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        refuse_sharded(self.lightning_module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            self._wrap(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        # every rank starts from rank 0's weights (and evaluates the same model outside fit)
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        for opt in self.optimizers if fitting else ():
            hvd.broadcast_optimizer_state(opt, root_rank=0)

    def _wrap(self, trainer: "pl.Trainer") -> None:
        lm = self.lightning_module
        if lm.automatic_optimization:
            passes = trainer.accumulate_grad_batches
            if self._backward_passes not in (None, passes):
                raise ValueError(f"HorovodStrategy(backward_passes_per_step={self._backward_passes}) with "
                                 f"Trainer(accumulate_grad_batches={passes}): under automatic optimization "
                                 "the Trainer's setting decides; give only accumulate_grad_batches")
        else:
            passes = self._backward_passes or 1
            if len(self.optimizers) > 1 and not self._allow_manual_multi:
                raise ValueError(
                    f"HorovodStrategy: manual optimization with {len(self.optimizers)} optimizers. Each "
                    "optimizer reduces its gradients as backward reaches them, so a backward that also "
                    "reaches another optimizer's parameters (a GAN's generator loss through the "
                    "discriminator) reduces those early and the next backward fails. Use one optimizer, "
                    "or make each backward reach only its optimizer's parameters (self.toggle_optimizer) "
                    "and pass HorovodStrategy(allow_manual_multi_optimizer=True)")
        self.optimizers = wrap_optimizers(lm, self.optimizers, [c.scheduler for c in self.lr_scheduler_configs],
                                          passes, self._optimizer_kwargs)

    # --- the step: reduce inside the closure, so clipping and unscaling see averaged gradients -
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not is_distributed(opt):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def reduced_closure():
            out = closure()
            opt.synchronize()
            return out

        with opt.skip_synchronize():
            return super().optimizer_step(optimizer, reduced_closure, model, **kwargs)

    # --- checkpoints: each rank's error-feedback residuals gathered; rank 0 writes ------------
    def optimizer_state(self, optimizer) -> dict:
        return gather_residuals(super().optimizer_state(optimizer))

    def load_optimizer_state_dict(self, checkpoint) -> None:
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            opt.load_state_dict(own_residuals(state, self.global_rank))
            _optimizer_to_device(opt, self.root_device)

    # --- collectives -------------------------------------------------------------------------
    def reduce(self, tensor, group=None, reduce_op="mean"):
        return collectives.reduce(tensor, group, reduce_op)

    def all_gather(self, tensor, group=None, sync_grads=False):
        return collectives.all_gather(tensor, group, sync_grads)

    def broadcast(self, obj, src: int = 0):
        return collectives.broadcast(obj, src)

    def barrier(self, name: Optional[str] = None) -> None:
        collectives.barrier()

    def teardown(self) -> None:
        # a later Trainer over the same module makes new optimizers; these must stop reducing
        for opt in self.optimizers:
            if is_distributed(opt) or is_outer_class(type(opt)):
                opt.remove_hooks()
        super().teardown()

    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, AssertionError) and "backward_passes_per_step" in str(exception):
            exception.args = (str(exception) + "; under Lightning: Trainer(accumulate_grad_batches=k) with "
                              "automatic optimization, HorovodStrategy(backward_passes_per_step=k) with manual",)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="hvdp's Horovod data parallelism")


def refuse_sharded(module: torch.nn.Module) -> None:
    """Model-parallel parameters (DTensor shards) cannot be averaged as whole tensors."""
    for name, p in module.named_parameters():
        if type(p.data).__name__ == "DTensor" or type(p).__name__ == "DTensor":
            raise ValueError(f"HorovodStrategy is data parallelism only: parameter {name} is a DTensor (model "
                             "parallel). Use Lightning's ModelParallelStrategy or FSDPStrategy, or hvdp.torch's "
                             "hvd.ProcessMesh for data parallelism inside tensor / pipeline parallelism")
