"""Run by test_keras_adapter.py under a given KERAS_BACKEND: prints, as JSON, the names of
horovod.tensorflow.keras (and its callbacks) and of horovod.tensorflow's collective API that
hvdp.keras lacks."""
import inspect
import json
import re

import horovod.tensorflow as ht
import horovod.tensorflow.keras as hk

import keras

import hvdp.keras as hvd

# Horovod's own helper (a version comparison), not part of its API
HELPERS = {"is_version_greater_equal_than"}
COLLECTIVE = re.compile(r"allreduce|allgather|alltoall|broadcast|reducescatter|join|process_set|"
                        r"^(Average|Sum|Adasum|Min|Max|Product)$|^SyncBatchNormalization$|"
                        r"^Distributed(Optimizer|GradientTape)$")


def public(mod):
    return {n for n in dir(mod) if not n.startswith("_") and not inspect.ismodule(getattr(mod, n))}


keras_names = public(hk) - HELPERS
callback_names = {n for n in public(hk.callbacks) if inspect.isclass(getattr(hk.callbacks, n))
                  and n.endswith(("Callback", "Checkpoint"))}
collective = {n for n in public(ht) if COLLECTIVE.search(n) and not n.endswith("_op")}
print(json.dumps({
    "backend": keras.backend.backend(),
    "keras": sorted(n for n in keras_names if not hasattr(hvd, n)),
    "callbacks": sorted(n for n in callback_names if not hasattr(hvd.callbacks, n)),
    "collective": sorted(n for n in collective if not hasattr(hvd, n)),
    "counts": [len(keras_names), len(callback_names), len(collective)],
}))
