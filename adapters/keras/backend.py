"""The one place where hvdp.keras depends on the Keras backend.

Everything else in the adapter is written once, against :data:`BACKEND`: the backend's array
ops (``hvdp.ops.ArrayOps``), its Horovod collectives (``hvdp.reduce.collectives``), where residuals
live, and a few control-plane helpers. Keras' TensorFlow backend runs on horovod.tensorflow,
its torch backend on horovod.torch; JAX has no Horovod ops.
"""
import os

SUPPORTED = ("tensorflow", "torch")


def _refuse(name):
    return ImportError(f"hvdp.keras runs on Keras' {' or '.join(SUPPORTED)} backend, but '{name}' is "
                       f"asked for (Horovod has no ops for it): set KERAS_BACKEND=tensorflow or "
                       f"KERAS_BACKEND=torch")


# checked before Keras is imported: Keras itself fails on a backend whose framework is missing
if os.environ.get("KERAS_BACKEND", "tensorflow") not in SUPPORTED:
    raise _refuse(os.environ["KERAS_BACKEND"])

import keras  # noqa: E402

NAME = keras.backend.backend()  # also from ~/.keras/keras.json
if NAME not in SUPPORTED:
    raise _refuse(NAME)

if NAME == "tensorflow":
    from ._backend_tf import BACKEND  # noqa: F401,E402
else:
    from ._backend_torch import BACKEND  # noqa: F401,E402
