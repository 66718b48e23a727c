"""``HorovodFabricStrategy``: Lightning Fabric over hvdp.torch, one process per device, started by
horovodrun / torchrun / srun (Fabric launches nothing; ``fabric.launch()`` just runs)."""
from contextlib import nullcontext
from typing import Any, Optional

import hvdp.torch as hvd
import torch
from hvdp.torch.optimizer import is_distributed
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_only

from . import collectives
from .checkpoint import KEY, gather_residuals, own_residuals
from .environment import HorovodEnvironment, ensure_init
from .optimizers import wrap_optimizers
from .strategy import refuse_sharded


class HorovodFabricStrategy(ParallelStrategy, _BackwardSyncControl):
    """Data parallelism with hvdp's ``DistributedOptimizer`` for ``lightning.fabric.Fabric``.

    The keyword arguments are those of ``hvdp.torch.DistributedOptimizer`` (with ``sync_every=H``:
    of ``hvdp.torch.OuterOptimizer``, outer steps). Set up the module with
    its optimizers in one call (``fabric.setup(model, opt)``). For gradient accumulation give
    ``backward_passes_per_step=k`` here and call ``optimizer.step()`` every k backward passes
    (``fabric.no_backward_sync`` changes nothing: the optimizer counts the passes).

    Example::

        fabric = Fabric(strategy=HorovodFabricStrategy(compression="int8"))
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    """

    strategy_name = "hvdp"

    def __init__(self, compression: Any = "none", backward_passes_per_step: int = 1, accelerator=None,
                 checkpoint_io=None, precision=None, **optimizer_kwargs: Any) -> None:
        ensure_init()
        super().__init__(accelerator=accelerator, cluster_environment=HorovodEnvironment(),
                         checkpoint_io=checkpoint_io, precision=precision)
        self._optimizer_kwargs = dict(optimizer_kwargs, compression=compression)
        self._backward_passes = backward_passes_per_step

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[0] if devices[0].type == "cpu" else torch.device(devices[0].type, self.local_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        devices = self.parallel_devices or []
        if len(devices) > 1 and devices[0].type == "cpu":
            raise ValueError(f"HorovodFabricStrategy: Fabric(devices={len(devices)}) asks Fabric to start "
                             "processes; with Horovod the launcher starts them, one per device: leave "
                             "devices at its default and run `horovodrun -np N python script.py`")
        rank_zero_only.rank = self.global_rank
        super().setup_environment()

    def module_to_device(self, module: torch.nn.Module) -> None:
        module.to(self.root_device)

    # --- set-up: optimizers wrapped, rank 0's state everywhere --------------------------------
    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        refuse_sharded(module)
        optimizers = wrap_optimizers(module, optimizers, [scheduler] if scheduler is not None else [],
                                     self._backward_passes, self._optimizer_kwargs)
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        for opt in optimizers:
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        return module, optimizers, scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        refuse_sharded(module)
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)  # evaluation: rank 0's weights
        return module

    def setup_optimizer(self, optimizer):
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if not is_distributed(optimizer):
            return super().optimizer_step(optimizer, **kwargs)
        optimizer.synchronize()  # before a GradScaler unscales, as Horovod's recipe does
        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, **kwargs)

    def no_backward_sync(self, module, enabled: bool):
        return nullcontext()

    # --- checkpoints: every rank's residuals in the file (rank 0 writes), each rank its own back
    def get_optimizer_state(self, optimizer) -> dict:
        return gather_residuals(super().get_optimizer_state(optimizer))

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None):
        io = self.checkpoint_io
        self.checkpoint_io = _OwnResiduals(io, self.global_rank)
        try:
            return super().load_checkpoint(path, state, strict, weights_only)
        finally:
            self.checkpoint_io = io

    # --- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor, group=None, reduce_op="mean"):
        return collectives.reduce(tensor, group, reduce_op)

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return collectives.all_gather(tensor, group, sync_grads)

    def broadcast(self, obj, src: int = 0):
        return collectives.broadcast(obj, src)

    def barrier(self, name: Optional[str] = None) -> None:
        collectives.barrier()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="hvdp's Horovod data parallelism")


class _OwnResiduals(CheckpointIO):
    """Reads through ``io``; an optimizer state saved with every rank's residuals (at the top or
    one level down) comes back holding this rank's."""

    def __init__(self, io: CheckpointIO, rank: int) -> None:
        self.io, self.rank = io, rank

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        ckpt = self.io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if isinstance(ckpt, dict) and KEY in ckpt:
            return own_residuals(ckpt, self.rank)
        if isinstance(ckpt, dict):
            return {k: own_residuals(v, self.rank) if isinstance(v, dict) and KEY in v else v for k, v in ckpt.items()}
        return ckpt

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path) -> None:
        self.io.remove_checkpoint(path)
