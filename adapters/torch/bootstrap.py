"""hvdp.torch's ``hvd.init``: Horovod's init, bootstrapped under torchrun-style launchers and srun
(``hvdp.cluster.bootstrap``), through torch's ``TCPStore`` at the launcher's address.

Example::

    import hvdp.torch as hvd
    hvd.init()            # under torchrun --nproc-per-node 2: a size-2 Horovod Gloo job
"""
import torch as _torch
import torch.distributed as _dist
from horovod.torch import init as _horovod_init
from horovod.torch import is_initialized as _is_initialized
from horovod.torch import size as _size

from hvdp.cluster import bootstrap as _bootstrap


def _group():
    """torch.distributed's initialised default group: (rank, size, name), or None."""
    if _dist.is_available() and _dist.is_initialized():
        return _dist.get_rank(), _dist.get_world_size(), "an initialised torch.distributed process group"
    return None


def _store(launcher):
    if launcher.kind == "group":  # the group's own store: no launcher address to serve one at
        return _bootstrap.group_store(_dist)
    return _bootstrap.tcp_store(_dist, launcher)


def init(comm=None, process_sets=None):
    """Horovod's ``init(comm=None, process_sets=None)``; under torchrun / srun without horovodrun
    it first starts Horovod's Gloo controller from the launcher's variables (or, without any
    launcher's variables, from an already initialised torch.distributed process group of several
    ranks, through its store); without a GPU it sets Horovod's cycle time to 5 ms where none is
    set (``hvdp.cluster.cycle``); and it raises where the launcher's world is larger than the job
    Horovod joined (never a silent size-1 job)."""
    _bootstrap.init(_horovod_init, _size, _is_initialized, comm, process_sets, make_store=_store,
                    group=_group, uses_gpu=_torch.cuda.is_available)
