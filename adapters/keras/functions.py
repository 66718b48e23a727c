"""Variable helpers for Keras 3 variables (Horovod's own expect tf.Variable.ref() or torch tensors)."""
from .agreement import check_broadcast
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
    B.broadcast_variables(variables, names, root_rank, process_set)


def broadcast_global_variables(root_rank):
    """Horovod's name for broadcasting TF1 graph collections; Keras 3 has none: see the error."""
    raise RuntimeError("hvd.broadcast_global_variables: Keras 3 keeps no global variable collection; "
                       "use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit, or "
                       "hvd.broadcast_variables(model.variables + optimizer.variables, root_rank)")
