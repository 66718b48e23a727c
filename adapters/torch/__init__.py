"""``import hvdp.torch as hvd``: everything ``horovod.torch`` offers, plus hvdp's compression.

Example::

    import hvdp.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression="int8")
"""
import importlib as _importlib

from hvdp.install.recipe import horovod_import_error as _horovod_import_error

try:
    from horovod.torch import *  # noqa: F401,F403  (every public name of horovod.torch)
except ImportError as _e:
    raise _horovod_import_error("hvdp.torch", _e) from _e

from hvdp import __version__  # noqa: F401
from hvdp.reduce.plan import CompressionPolicy  # noqa: F401
from hvdp.reduce.join import JoinRefused  # noqa: F401

from .bootstrap import init  # noqa: F401  (Horovod's, bootstrapped under torchrun / srun: hvdp.cluster.bootstrap)
from .agreement import broadcast_parameters  # noqa: F401  (checks the ranks agree first)
from .checkpoint import load_checkpoint, save_checkpoint  # noqa: F401
from .compression import Compression  # noqa: F401
from .functions import broadcast_optimizer_state  # noqa: F401
from .join import join  # noqa: F401  (Horovod's join, safe with every codec: hvdp.reduce.join)
from . import kernels as _kernels  # noqa: F401  (registers the CUDA codec kernels)
from .mesh import ProcessMesh  # noqa: F401  (DP x TP x PP groups as process sets: hvdp.cluster.mesh)
from .mesh import hierarchical_process_sets  # noqa: F401  (hvdp.cluster.topology's static process sets)
from .ops import TorchOps  # noqa: F401
from .distributed import DistributedOptimizer  # noqa: F401
from .outer import OuterOptimizer  # noqa: F401  (outer steps every H inner steps: hvdp.outer)
from .watched import watched_collectives as _watched_collectives
from . import waits as _waits
from hvdp.cluster import exits as _exits

# Horovod's blocking collectives (hvd.allreduce, hvd.broadcast_object, ...) under the stall
# watchdog: a rank that never arrives is named within HVDP_STALL_TIMEOUT_SECONDS
globals().update(_watched_collectives())
# every wait for a horovod.torch collective in this process sleeps between polls instead of
# spinning a core (hvdp.torch.waits; HVDP_SLEEPING_WAIT=0 keeps Horovod's)
_waits.install()
# Horovod's shutdown, first waiting for the other ranks to end where hvdp made process sets
# smaller than the job (a two-level reduction, a mesh: hvdp.cluster.exits)
shutdown = _exits.ending(shutdown)  # noqa: F405

# hvdp's elastic module replaces horovod.torch.elastic (which the * import bound to this name,
# so `from . import elastic` would silently return Horovod's)
elastic = _importlib.import_module(".elastic", __name__)
