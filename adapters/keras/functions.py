"""Variable helpers for Keras 3 variables (Horovod's own expect tf.Variable.ref() or torch tensors),
and Horovod's module collectives taking what Keras users pass."""
import functools
from .agreement import WATCHDOG, check_broadcast
from .backend import BACKEND as B


def broadcast_variables(variables, root_rank, process_set=B.hvd.global_process_set):
    """Assign rank ``root_rank``'s values to ``variables`` (Keras 3 variables; tf.Variables on
    the TensorFlow backend) on every rank, after checking that every rank passes the same names,
    shapes and dtypes.

    Example::

        hvd.broadcast_variables(model.variables, root_rank=0)
    """
    variables = list(variables)
    names = [getattr(v, "path", None) or v.name for v in variables]
    check_broadcast(variables, names, root_rank, process_set)
    with WATCHDOG.waiting("hvd.broadcast_variables"):
        B.broadcast_variables(variables, names, root_rank, process_set)


def broadcast_global_variables(root_rank):
    """Horovod's name for broadcasting TF1 graph collections; Keras 3 has none: see the error."""
    raise RuntimeError("hvd.broadcast_global_variables: Keras 3 keeps no global variable collection; "
                       "use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit, or "
                       "hvd.broadcast_variables(model.variables + optimizer.variables, root_rank)")


def accepting_values(fn):
    """Horovod's collective ``fn`` taking what horovod.tensorflow.keras's take on every backend:
    numpy arrays, Python numbers and lists, backend tensors, Keras variables (a list of them for
    the ``grouped_`` forms). The result is the backend's tensor (``tf.Tensor`` on TensorFlow, as
    horovod.tensorflow.keras returns in eager mode; ``torch.Tensor`` on torch)."""
    grouped = fn.__name__.startswith("grouped_")

    @functools.wraps(fn)
    def wrapped(value, *args, **kwargs):
        if grouped:
            value = [B.collective_input(x) for x in value]
        else:
            value = B.collective_input(value)
        return fn(value, *args, **kwargs)
    return wrapped


def watched(fn):
    """Horovod's blocking collective ``fn`` under the stall watchdog (``hvdp.cluster.watchdog``):
    a rank that never arrives is named within the deadline; a call while a graph is traced only
    adds an op (not timed)."""
    return WATCHDOG.watched(fn, tracing=B.tracing)


# the blocking collectives hvdp.keras exports, watched in __init__
BLOCKING = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "grouped_allgather",
            "grouped_allreduce", "grouped_reducescatter", "broadcast_object", "allgather_object",
            "broadcast_")


# horovod.tensorflow.keras's own signatures (value first, then name: a positional name means the
# same as in Horovod), on either backend's Horovod; further keywords (process_set=, ...) pass on.
def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=None, **kwargs):
    """The average (or ``op``) of ``value`` over the ranks, as horovod.tensorflow.keras's."""
    if compression is not None:
        kwargs["compression"] = compression
    return B.hvd.allreduce(B.collective_input(value), name=name, average=average,
                           prescale_factor=prescale_factor, postscale_factor=postscale_factor, op=op,
                           **kwargs)


def allgather(value, name=None, **kwargs):
    """Every rank's ``value`` concatenated along the first dimension, as horovod.tensorflow.keras's."""
    return B.hvd.allgather(B.collective_input(value), name=name, **kwargs)


def broadcast(value, root_rank, name=None, **kwargs):
    """Rank ``root_rank``'s ``value`` on every rank, as horovod.tensorflow.keras's."""
    return B.hvd.broadcast(B.collective_input(value), root_rank, name=name, **kwargs)


def reducescatter(value, name=None, op=None, **kwargs):
    """This rank's slice of the reduction of ``value``, as horovod.tensorflow.keras's."""
    if op is not None:
        kwargs["op"] = op
    return B.hvd.reducescatter(B.collective_input(value), name=name, **kwargs)
