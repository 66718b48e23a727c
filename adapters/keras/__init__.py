"""``import hvdp.keras as hvd``: the API of horovod.tensorflow.keras, working on Keras 3.

Needs Keras >= 3 with the TensorFlow backend (over horovod.tensorflow) or the torch backend
(over horovod.torch); the backend-specific part is ``backend.py``.

Example::

    import hvdp.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()),
                                                     compression="int8"), loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
"""
from .backend import SUPPORTED as _SUPPORTED  # noqa: F401  (refuses other backends, JAX)
import keras as _keras  # noqa: E402

if int(_keras.__version__.split(".")[0]) < 3:
    raise ImportError(f"hvdp.keras needs Keras 3 (found {_keras.__version__}); for tf.keras 2 use "
                      "horovod.tensorflow.keras")

from hvdp.install.recipe import horovod_import_error as _horovod_import_error  # noqa: E402

try:
    from .backend import BACKEND as _B
except ImportError as _e:
    raise _horovod_import_error("hvdp.keras", _e) from _e

# every name of Horovod's collective API, from the backend's Horovod (horovod.tensorflow or
# horovod.torch: the same names)
_HOROVOD = ["Adasum", "Average", "Sum", "Min", "Max", "Product", "ProcessSet", "add_process_set",
            "allgather", "allgather_object", "allreduce", "alltoall", "broadcast", "broadcast_object",
            "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set",
            "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce",
            "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
            "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank",
            "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline",
            "stop_timeline", "broadcast_"]
globals().update({_n: getattr(_B.hvd, _n, None) or getattr(_B.hvd.mpi_ops._basics, _n) for _n in _HOROVOD})
# numpy arrays, Python numbers, backend tensors and Keras variables, on either backend; the four
# that horovod.tensorflow.keras defines with its own signatures (value, name=None, ...)
from .functions import accepting_values as _accepting_values  # noqa: E402
from .functions import allgather, allreduce, broadcast, reducescatter  # noqa: E402,F401,F811
for _n in ("alltoall", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter"):
    globals()[_n] = _accepting_values(globals()[_n])
# each blocking one under the stall watchdog: a rank that never arrives is named within
# HVDP_STALL_TIMEOUT_SECONDS (hvdp.cluster.watchdog)
from .functions import BLOCKING as _BLOCKING, watched as _watched  # noqa: E402
for _n in _BLOCKING:
    if globals().get(_n) is not None:
        globals()[_n] = _watched(globals()[_n])
# Horovod's shutdown, first waiting for the other ranks to end where hvdp made process sets
# smaller than the job (a two-level reduction, a mesh: hvdp.cluster.exits)
from hvdp.cluster import exits as _exits  # noqa: E402
shutdown = _exits.ending(shutdown)  # noqa: F821
if hasattr(_B.hvd, "broadcast_object_fn"):  # horovod.tensorflow only
    broadcast_object_fn = _B.hvd.broadcast_object_fn


def init(comm=None, process_sets=None):
    """Horovod's ``init(comm=None, process_sets=None)``; under torchrun / srun without horovodrun
    it first starts Horovod's Gloo controller from the launcher's variables (``hvdp.cluster.bootstrap``,
    through torch's TCPStore, on either backend where torch is installed, as it is wherever torchrun
    runs); without a GPU it sets Horovod's cycle time to 5 ms where none is set
    (``hvdp.cluster.cycle``); and it raises where the launcher's world is larger than the job Horovod joined (never a
    silent size-1 job)."""
    import importlib
    import importlib.util

    from hvdp.cluster import bootstrap as _bootstrap

    def store(launcher):
        return _bootstrap.tcp_store(importlib.import_module("torch.distributed"), launcher)

    _bootstrap.init(_B.hvd.init, _B.hvd.size, _B.hvd.is_initialized, comm, process_sets,
                    make_store=store if importlib.util.find_spec("torch") else None, uses_gpu=_B.uses_gpu)

from hvdp import __version__  # noqa: E402,F401
from hvdp.codecs import Compression  # noqa: E402,F401
from hvdp.reduce.join import JoinRefused  # noqa: E402,F401
from hvdp.reduce.plan import CompressionPolicy  # noqa: E402,F401

from . import callbacks, elastic  # noqa: E402,F401
from .checkpoint import save_checkpoint  # noqa: E402,F401
from .functions import broadcast_global_variables, broadcast_variables  # noqa: E402,F401
from .join import join  # noqa: E402,F401  (Horovod's join, safe with every codec: hvdp.reduce.join)
from .mesh import ProcessMesh  # noqa: E402,F401  (DP x TP x PP groups as process sets: hvdp.cluster.mesh)
from .mesh import hierarchical_process_sets  # noqa: E402,F401  (hvdp.cluster.topology's static process sets)
from .optimizer import DistributedOptimizer  # noqa: E402,F401
from .outer import OuterOptimizer  # noqa: E402,F401  (outer steps every H inner steps: hvdp.outer)
from .saving import load_checkpoint, load_model  # noqa: E402,F401
from .syncbn import SyncBatchNormalization  # noqa: E402,F401

if _B.name == "tensorflow":
    from .ops import TFOps  # noqa: E402,F401
    from .tape import DistributedGradientTape  # noqa: E402,F401
else:
    from hvdp.torch.ops import TorchOps  # noqa: E402,F401

    def DistributedGradientTape(*args, **kwargs):
        """TensorFlow's gradient tape has no torch counterpart: see the error."""
        raise RuntimeError("hvd.DistributedGradientTape needs Keras' TensorFlow backend; on the torch "
                           "backend compute gradients with loss.backward() and pass them to "
                           "hvd.DistributedOptimizer(opt).apply(grads, model.trainable_variables)")
