"""hvdp.keras against horovod.tensorflow.keras (issue 27's compatibility suite), on the backend
KERAS_BACKEND names: the API surface (TensorFlow: Horovod's names, parameters in Horovod's
order), and Horovod's module collectives given what Keras users pass (numpy arrays, Python
numbers and lists, Keras variables, backend tensors) — on TensorFlow the same type, dtype and
values as horovod.tensorflow.keras in the same job; on torch a torch tensor with the values
numpy gives. Prints 'CHECK <name> OK rank=<r>' (tests/parallel/test_horovod_compat.py)."""
import inspect
import os
import sys

import keras
import numpy as np

import hvdp.keras as hvd

TF = keras.backend.backend() == "tensorflow"
if TF:
    import horovod.tensorflow.keras as H
# on purpose absent: Horovod's version helper (not an API of training scripts)
NOT_OURS = {"is_version_greater_equal_than"}


def _params(f):
    return list(inspect.signature(f).parameters)


def check_api_surface():
    """Every public name of horovod.tensorflow.keras, its callbacks and elastic classes is in
    hvdp.keras; functions and callbacks take Horovod's parameters in Horovod's order."""
    if not TF:  # horovod.tensorflow.keras needs TensorFlow: the torch backend has the same names
        H_names = ["allreduce", "allgather", "broadcast", "DistributedOptimizer", "callbacks", "elastic", "join"]
        assert all(hasattr(hvd, n) for n in H_names)
        return
    missing = [n for n in dir(H) if not n.startswith("_") and not inspect.ismodule(getattr(H, n))
               and not hasattr(hvd, n) and n not in NOT_OURS]
    import horovod.tensorflow.keras.callbacks as HC
    import horovod.tensorflow.keras.elastic as HE
    missing += [f"callbacks.{n}" for n in dir(HC) if n.endswith("Callback") and not hasattr(hvd.callbacks, n)]
    missing += [f"elastic.{n}" for n in dir(HE) if not n.startswith("_") and not inspect.ismodule(getattr(HE, n))
                and not hasattr(hvd.elastic, n)]
    assert not missing, missing
    pairs = [(n, getattr(H, n), getattr(hvd, n)) for n in dir(H)
             if inspect.isfunction(getattr(H, n)) and n not in NOT_OURS | {"init"}]  # Horovod's init: (*args, **kwargs)
    pairs += [(f"callbacks.{n}", getattr(HC, n), getattr(hvd.callbacks, n)) for n in dir(HC) if n.endswith("Callback")]
    for name, theirs, ours in pairs:
        t, o = _params(theirs), _params(ours)
        assert o[:len(t)] == t, (name, t, o)


def inputs(tag):
    r = float(hvd.rank() + 1)
    return {"numpy64": np.arange(4.0) * r, "numpy32": (np.arange(4) * r).astype("float32"),
            "float": 2.5 * r, "int": 3 * int(r), "list": [1.0 * r, 2.0 * r],
            "variable": keras.Variable(np.full(3, r, dtype="float32"), name=f"{tag}v"),
            "tensor": keras.ops.convert_to_tensor(np.full(2, r, dtype="float32"))}


def _np(x):
    return keras.ops.convert_to_numpy(x)


def _same(ours, theirs, what):
    assert type(ours) is type(theirs), (what, type(ours), type(theirs))
    assert keras.backend.standardize_dtype(ours.dtype) == keras.backend.standardize_dtype(theirs.dtype), what
    np.testing.assert_array_equal(_np(ours), _np(theirs), err_msg=what)


def check_collectives():
    """allreduce (name given positionally, as Horovod's Keras signature allows), allgather and
    broadcast on every kind of input; grouped_allreduce, allgather_object and broadcast_object
    (horovod.tensorflow's: horovod.tensorflow.keras has none of the three) on their own."""
    size = hvd.size()
    for kind, x in inputs("c").items():
        base = np.asarray(_np(x) if kind in ("variable", "tensor") else x, dtype="float64") / (hvd.rank() + 1)
        mean = base * (size + 1) / 2  # rank r holds base * (r + 1)
        got = hvd.allreduce(x, f"c.ar.{kind}")  # Horovod's Keras order: (value, name)
        one_d = np.atleast_1d(x) if kind in ("float", "int") else x  # allgather needs a dimension
        gathered = hvd.allgather(one_d, name=f"c.ag.{kind}")
        bcast = hvd.broadcast(x, 0, name=f"c.bc.{kind}")
        if TF:
            _same(got, H.allreduce(x, f"c.har.{kind}"), f"allreduce {kind}")
            _same(gathered, H.allgather(one_d, name=f"c.hag.{kind}"), f"allgather {kind}")
            _same(bcast, H.broadcast(x, 0, name=f"c.hbc.{kind}"), f"broadcast {kind}")
        else:
            import torch
            assert all(isinstance(t, torch.Tensor) for t in (got, gathered, bcast)), (kind, type(got))
        if kind != "int":  # Horovod averages an integer tensor by integer division
            np.testing.assert_allclose(_np(got), mean, rtol=1e-6, err_msg=kind)
        np.testing.assert_allclose(_np(bcast), base, rtol=1e-6, err_msg=kind)  # rank 0's value
        np.testing.assert_allclose(_np(gathered).reshape(size, -1),
                                   [np.atleast_1d(base) * (r + 1) for r in range(size)], rtol=1e-6, err_msg=kind)
    a, b = hvd.grouped_allreduce([np.ones(3) * hvd.rank(), np.ones(2) * hvd.rank()], name="c.gar")
    np.testing.assert_allclose(_np(a), np.full(3, (size - 1) / 2))
    np.testing.assert_allclose(_np(b), np.full(2, (size - 1) / 2))
    assert hvd.allgather_object(hvd.rank(), name="c.ago") == list(range(size))
    assert hvd.broadcast_object({"r": hvd.rank()}, 0, name="c.bco") == {"r": 0}


CHECKS = {"api_surface": check_api_surface, "collectives": check_collectives}

if __name__ == "__main__":
    hvd.init()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from case_report import run_named_checks
    run_named_checks(CHECKS, sys.argv[1:], hvd.rank)
