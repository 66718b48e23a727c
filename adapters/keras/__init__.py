"""``import hvdp.keras as hvd``: the API of horovod.tensorflow.keras, working on Keras 3.

Needs Keras >= 3 with the TensorFlow backend (TF 2.21's default).

Example::

    import hvdp.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()),
                                                     compression="int8"), loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
"""
import keras as _keras

if int(_keras.__version__.split(".")[0]) < 3:
    raise ImportError(f"hvdp.keras needs Keras 3 (found {_keras.__version__}); for tf.keras 2 use "
                      "horovod.tensorflow.keras")
if _keras.backend.backend() != "tensorflow":
    raise ImportError(f"hvdp.keras runs on Keras' TensorFlow backend, but '{_keras.backend.backend()}' "
                      "is active: set KERAS_BACKEND=tensorflow (for the torch backend use hvdp.torch's "
                      "collectives)")

from hvdp.install.recipe import horovod_import_error as _horovod_import_error  # noqa: E402

try:
    from horovod.tensorflow import (Adasum, Average, ProcessSet, Sum, add_process_set,  # noqa: F401
                                    allgather, allgather_object, allreduce, alltoall, broadcast,
                                    broadcast_object, ccl_built, cross_rank, cross_size, cuda_built,
                                    ddl_built, global_process_set, gloo_built, gloo_enabled,
                                    grouped_allreduce, init, is_homogeneous, is_initialized, join,
                                    local_rank, local_size, mpi_built, mpi_enabled,
                                    mpi_threads_supported, nccl_built, rank, remove_process_set,
                                    rocm_built, shutdown, size, start_timeline, stop_timeline)
except ImportError as _e:
    raise _horovod_import_error("hvdp.keras", _e) from _e

from hvdp import __version__  # noqa: E402,F401
from hvdp.plan import CompressionPolicy  # noqa: E402,F401

from . import callbacks, elastic  # noqa: E402,F401
from hvdp.codecs import Compression  # noqa: E402,F401
from .functions import broadcast_variables  # noqa: E402,F401
from .ops import TFOps  # noqa: E402,F401
from .optimizer import DistributedGradientTape, DistributedOptimizer  # noqa: E402,F401
from .saving import load_model  # noqa: E402,F401
from .join import join  # noqa: E402,F401  (Horovod's join, safe with every codec: hvdp.join)
from .mesh import ProcessMesh  # noqa: E402,F401  (DP x TP x PP groups as process sets: hvdp.mesh)
from hvdp.join import JoinRefused  # noqa: E402,F401
