"""hvdp.torch's ``hvd.init``: Horovod's init, bootstrapped under torchrun-style launchers and srun
(``hvdp.bootstrap``), through torch's ``TCPStore`` at the launcher's address.

Example::

    import hvdp.torch as hvd
    hvd.init()            # under torchrun --nproc-per-node 2: a size-2 Horovod Gloo job
"""
import torch.distributed as _dist
from horovod.torch import init as _horovod_init
from horovod.torch import is_initialized as _is_initialized
from horovod.torch import size as _size

from hvdp import bootstrap as _bootstrap


def init(comm=None, process_sets=None):
    """Horovod's ``init(comm=None, process_sets=None)``; under torchrun / srun without horovodrun
    it first starts Horovod's Gloo controller from the launcher's variables, and it raises where
    the launcher's world is larger than the job Horovod joined (never a silent size-1 job)."""
    _bootstrap.init(_horovod_init, _size, _is_initialized, comm, process_sets,
                    make_store=lambda launcher: _bootstrap.tcp_store(_dist, launcher))
