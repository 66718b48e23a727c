"""Where hvdp.keras keeps its state on a Keras object: one object, one accessor.

A distributed optimizer carries one :class:`~hvdp.keras.reducer.OptimizerReducer` (its settings
and its internal state, fields documented there), shared with a ``LossScaleOptimizer`` that Keras
wraps around it later; a ``DistributedGradientTape`` carries the ``GradientReducer`` of its last
``gradient`` call. This module alone reads and writes the attribute they are kept under; every
other module calls :func:`state_of`.

Example::

    red = state_of(model.optimizer)  # None unless the optimizer is hvdp's
    if red is not None:
        print(red.engine.summary())
"""

_ATTR = "_hvdp"  # on the optimizer (or tape) object itself: no registry to keep in step


def state_of(obj):
    """hvdp's reducer kept on ``obj`` (an optimizer made distributed, or a gradient tape), or
    None for any other object (``None`` included)."""
    return getattr(obj, _ATTR, None)


def attach(obj, reducer):
    """Keep ``reducer`` on ``obj`` (called by the module that makes ``obj`` hvdp's)."""
    setattr(obj, _ATTR, reducer)


_OUTER = "_hvdp_outer_steps"  # an hvd.OuterOptimizer's outer loop (hvdp.keras.outer)


def outer_of(obj):
    """The outer steps kept on ``obj`` (an ``hvd.OuterOptimizer``), or None."""
    return getattr(obj, _OUTER, None)


def attach_outer(obj, outer):
    setattr(obj, _OUTER, outer)
