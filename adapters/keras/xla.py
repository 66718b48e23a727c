"""hvdp.keras and XLA: Horovod's XLA ops are not built (TF 2.21), so no collective may sit in an
XLA-compiled function.

- ``refuse_xla``: the clear error while tracing, before TF's "No registered 'HorovodAllreduce'
  OpKernel for XLA_..." (explicit ``jit_compile=True``; a tape inside ``tf.function(jit_compile=True)``).
- ``install_auto_jit_veto``: Keras' default ``compile(jit_compile="auto")`` picks XLA whenever a GPU
  is visible, and Keras 3 asks only the layers (``supports_jit``), never the optimizer. So "auto"
  resolves to False for a model whose optimizer is hvdp's: the default compile trains on a GPU
  node, and an explicit ``jit_compile=True`` still gets ``refuse_xla``'s error.

Keras' torch backend has no XLA: there ``refuse_xla`` is not used and "auto" is eager already.
"""
from .state import outer_of, state_of


def refuse_xla(what="the train step is", fix="compile the model with jit_compile=False"):
    """Raise hvdp's clear error when called while an XLA-compiled function is traced."""
    import tensorflow as tf
    try:
        from tensorflow.python.ops import control_flow_util
        in_xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # private helper moved: cannot tell, let TF report it
        return
    if in_xla:
        raise RuntimeError(f"hvdp.keras: {what} XLA-compiled, but Horovod's XLA ops are not "
                           f"built for TF 2.21; {fix}")


def is_distributed(optimizer) -> bool:
    """hvdp's optimizer, also when Keras wrapped it (LossScaleOptimizer's ``inner_optimizer``)."""
    while optimizer is not None:
        if state_of(optimizer) is not None or outer_of(optimizer) is not None:
            return True
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return False


def install_auto_jit_veto():
    """Wrap Keras' resolution of ``jit_compile="auto"`` (``Trainer._resolve_auto_jit_compile``, the
    only place "auto" is decided; explicit True/False never reach it): False when the model's
    optimizer is hvdp's, Keras' own answer otherwise. Idempotent; a Keras without that method is
    left alone (a GPU node then gets ``refuse_xla``'s error naming jit_compile=False)."""
    from keras.src.trainers.trainer import Trainer
    original = Trainer.__dict__.get("_resolve_auto_jit_compile")
    if original is None or getattr(original, "_hvdp_veto", False):
        return

    def _resolve_auto_jit_compile(self):
        if is_distributed(getattr(self, "optimizer", None)):
            return False
        return original(self)

    _resolve_auto_jit_compile._hvdp_veto = True
    _resolve_auto_jit_compile.__doc__ = original.__doc__
    Trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile
