"""hvdp.keras on Keras' torch backend: horovod.torch's collectives and the torch array ops of
hvdp.torch; Keras runs the train step eagerly here, so residuals and accumulators are plain
tensors."""
import horovod.torch as hvd
import numpy as np
import torch
from horovod.torch.elastic import run as _torch_elastic_run
from keras.src.backend.torch.core import get_device

from hvdp.torch.comm import TorchCollectives
from hvdp.torch.ops import TorchOps


class TensorStore:
    """Residuals as tensors on Keras' device; snapshots are numpy (checkpoints, elastic commits)."""

    def __init__(self, prefix):
        self.prefix, self.vars = prefix, {}

    def create(self, name, n):
        """A zero residual of n elements; one of another size (a new layout) is replaced."""
        v = self.vars.get(name)
        if v is None or v.numel() != n:
            self.vars[name] = torch.zeros(n, dtype=torch.float32, device=get_device())

    def get(self, name):
        return self.vars.get(name)

    def set(self, name, value):
        self.vars[name] = value

    def snapshot(self):
        return {k: v.detach().cpu().numpy().copy() for k, v in self.vars.items()}

    def restore(self, data):
        """Residuals from ``data`` (numpy arrays or tensors) where present and of the right size;
        zero otherwise."""
        for k, var in list(self.vars.items()):
            v = data.get(k)
            if torch.is_tensor(v):  # np.size of a tensor is not its size
                v = v.detach().cpu().numpy()
            ok = v is not None and var.numel() == np.size(v)
            self.vars[k] = (torch.as_tensor(np.asarray(v), dtype=torch.float32).to(var.device).clone()
                            if ok else torch.zeros_like(var))


class Buffer:
    """A local accumulator (``backward_passes_per_step``)."""

    def __init__(self, shape, dtype="float32"):
        self.t = torch.zeros(tuple(shape), dtype=getattr(torch, dtype), device=get_device())

    def add(self, x):
        self.t.add_(torch.as_tensor(x).to(self.t.dtype))

    def read(self):
        return self.t

    def reset(self):
        self.t.zero_()


class Switch:
    """A yes/no that the eager part of a step sets and the step reads (Keras runs the torch
    backend's steps eagerly: a Python bool, no device read)."""

    def __init__(self, on, name=""):
        self.on = bool(on)

    def set(self, on):
        self.on = bool(on)

    def when(self, fn, otherwise, token=None):
        """``fn()`` where the switch is on, else ``otherwise``."""
        return fn() if self.on else otherwise


class TorchBackend:
    name = "torch"
    hvd = hvd
    ops = TorchOps()
    Collectives = TorchCollectives
    Store = TensorStore
    Buffer = Buffer
    Switch = Switch
    elastic_run = staticmethod(_torch_elastic_run)
    eager_steps = True  # Keras runs the torch backend's train step eagerly: auto per bucket
    tensor_types = (torch.Tensor,)  # what horovod.torch's compressors take
    uses_gpu = staticmethod(torch.cuda.is_available)  # Horovod's cycle time: hvdp.cluster.cycle

    @staticmethod
    def collective_input(x):
        """A torch tensor for horovod.torch's collectives, which take tensors only: numpy arrays,
        Python numbers and lists as CPU tensors (``torch.as_tensor``), a Keras variable by its value."""
        if isinstance(x, torch.Tensor):
            return x
        if hasattr(x, "path") and hasattr(x, "value"):  # a Keras variable
            return x.value.detach()
        return torch.as_tensor(np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x)

    @staticmethod
    def tracing():
        return False

    @staticmethod
    def watch(dog, name, grads, fn):
        """``fn(grads)``: its waits are already under the stall watchdog (horovod.torch's, through
        ``TorchCollectives``)."""
        return fn(grads)

    @staticmethod
    def init_scope():
        import contextlib
        return contextlib.nullcontext()

    @staticmethod
    def refuse_xla(what="", fix=""):
        """Keras' torch backend has no XLA; ``jit_compile=True`` (torch.compile) runs Horovod's
        ops outside the compiled graph."""

    @staticmethod
    def op_name(name):
        return name

    @staticmethod
    def is_sparse(g):
        return False

    @staticmethod
    def dense(g):
        return g

    @staticmethod
    def allgather_np(arr, name, process_set=hvd.global_process_set):
        return hvd.allgather(torch.from_numpy(np.array(arr)), name=name,
                             process_set=process_set).numpy()

    @staticmethod
    def allreduce_np(arr, name, average=True):
        return hvd.allreduce(torch.from_numpy(np.array(arr)), name=name,
                             op=hvd.Average if average else hvd.Sum).numpy()

    @staticmethod
    def broadcast_variables(variables, names, root_rank, process_set):
        # submitted all at once, waited once (each collective waits for Horovod's cycle)
        handles = [hvd.broadcast_async(v.value.detach(), root_rank, name=f"hvdp.bcast.{i}.{name}",
                                       process_set=process_set)
                   for i, (v, name) in enumerate(zip(variables, names))]
        for v, h in zip(variables, handles):
            v.assign(hvd.synchronize(h))

    @staticmethod
    def eager_call(fn, after=()):
        """``fn()`` at once (the torch backend's steps run eagerly)."""
        fn()

    @staticmethod
    def run_after(token, fn):
        return fn()

    @staticmethod
    def one():
        return torch.ones(1)

    @staticmethod
    def horovod_join() -> int:
        return int(hvd.join())

    @staticmethod
    def allreduce_differentiable(x, name, process_set=hvd.global_process_set):
        """Sum over the workers; horovod.torch's allreduce is an autograd function."""
        return hvd.allreduce(x, op=hvd.Sum, name=name, process_set=process_set)


BACKEND = TorchBackend()
