"""hvdp.torch's ``hvd.init``: Horovod's init, bootstrapped under torchrun-style launchers and srun
(``hvdp.bootstrap``), through torch's ``TCPStore`` at the launcher's address.

Example::

    import hvdp.torch as hvd
    hvd.init()            # under torchrun --nproc-per-node 2: a size-2 Horovod Gloo job
"""
import datetime
import os

from horovod.torch import init as _horovod_init
from horovod.torch import is_initialized as _is_initialized
from horovod.torch import size as _size

from hvdp import bootstrap as _bootstrap

STORE_TIMEOUT_S = 300  # how long a rank waits for the others' host names and rank 0's plan
_STORES = []           # kept alive: rank 0's may serve the others, Horovod's rendezvous outlives init
_GENERATION = [0]      # a second init (after shutdown) uses fresh keys


def tcp_store(launcher):
    """torch's TCPStore at the launcher's address: a client of torchrun's agent store where the
    agent hosts one (TORCHELASTIC_USE_AGENT_STORE), else served by rank 0 (multi-tenant, so a later
    init_process_group on the same port shares it). Keys under hvdp/<restart>/<generation>/."""
    import torch.distributed as dist
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(launcher.addr, launcher.port, launcher.size,
                          is_master=launcher.rank == 0 and not agent,
                          timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S), multi_tenant=True)
    _STORES.append(store)
    _GENERATION[0] += 1
    prefix = f"hvdp/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_GENERATION[0]}/"
    return dist.PrefixStore(prefix, store)


def init(comm=None, process_sets=None):
    """Horovod's ``init(comm=None, process_sets=None)``; under torchrun / srun without horovodrun
    it first starts Horovod's Gloo controller from the launcher's variables, and it raises where
    the launcher's world is larger than the job Horovod joined (never a silent size-1 job)."""
    _bootstrap.init(_horovod_init, _size, _is_initialized, comm, process_sets, make_store=tcp_store)
