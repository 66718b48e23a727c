"""Horovod's per-variable options of ``hvd.DistributedOptimizer`` for Keras 3: worker-local
variables (``register_local_var``, ``scale_local_gradients``), explicit ``groups``, and the
placement arguments ``device_dense`` / ``device_sparse``.

A local variable's gradient never reaches a collective: each worker keeps its own, divided by
the number of workers when ``scale_local_gradients`` is on (Horovod's default, so that a local
variable moves as much per step as it would under an average of equal gradients).
"""
import warnings

import keras

from .backend import BACKEND as B


def check_arguments(device_dense, device_sparse, num_groups, groups):
    """Horovod's checks of these arguments; -> the ``groups`` to use (``num_groups`` folded in)."""
    for label, dev in (("device_dense", device_dense), ("device_sparse", device_sparse)):
        if not isinstance(dev, str):
            raise TypeError(f"{label} is a device string as in Horovod (e.g. '' or '/gpu:0'), got "
                            f"{type(dev).__name__}")
    if num_groups:
        warnings.warn("num_groups is deprecated (as in Horovod): use groups=", DeprecationWarning, stacklevel=3)
        groups = groups if groups is not None else num_groups
    if groups is not None and not (isinstance(groups, (list, tuple)) or (isinstance(groups, int) and groups > 0)):
        raise ValueError(f"groups is a positive number of groups or a list of lists of variables "
                         f"(as in Horovod), got {groups!r}")
    return groups


def group_names(groups, variables, names):
    """Horovod's groups as tuples of variable names (for the ranks-agree check). An int splits
    the variables into that many runs in order; a list's inner lists are kept, restricted to the
    variables reduced now (a frozen or local variable drops out of its group)."""
    if not groups:
        return ()
    if isinstance(groups, int):
        k = -(-len(names) // groups) if names else 1
        return tuple(tuple(names[i:i + k]) for i in range(0, len(names), k))
    index = {id(v): n for v, n in zip(variables, names)}
    out = (tuple(index[id(v)] for v in g if id(v) in index) for g in groups)
    return tuple(g for g in out if g)


class LocalVariables:
    """The variables registered with ``register_local_var``, and what a step does with them."""

    def __init__(self, scale: bool):
        self.scale = bool(scale)
        self._vars = {}  # id -> variable (kept alive: ids stay unique)

    def add(self, var):
        if not isinstance(var, keras.Variable) and not (B.name == "tensorflow" and hasattr(var, "ref")):
            raise TypeError(f"register_local_var takes a Keras variable (e.g. layer.kernel), got "
                            f"{type(var).__name__}")
        self._vars[id(var)] = var

    def __bool__(self):
        return bool(self._vars)

    def shared(self, variables):
        """The variables whose gradients are reduced (every one but the local ones)."""
        return [v for v in variables if id(v) not in self._vars]

    def reduce(self, reduce_fn, grads, variables, size):
        """``reduce_fn`` over the shared variables' gradients; the local ones stay this worker's
        (divided by ``size`` when scaling), in the order given."""
        if not self._vars:
            return reduce_fn(grads)
        idx = [i for i, v in enumerate(variables) if id(v) not in self._vars]
        out = list(grads)
        for i, g in zip(idx, reduce_fn([grads[i] for i in idx]) if idx else ()):
            out[i] = g
        if self.scale:
            for i, v in enumerate(variables):
                if id(v) in self._vars and grads[i] is not None:
                    g = B.dense(grads[i]) if B.is_sparse(grads[i]) else grads[i]
                    out[i] = g / size
        return out
