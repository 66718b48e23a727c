"""``hvd.join()`` for hvdp's Keras optimizers, the in-graph join control, and ``JoinCallback``
for ``model.fit`` with shards of different lengths. The rules are the core's (``hvdp.reduce.join``)."""
import gc

import keras

from hvdp.reduce.collectives import SUM
from hvdp.reduce.join import CONTROL_NAME, JoinRefused, Registry

from .backend import BACKEND as B
from .functions import broadcast_variables
from .state import outer_of, state_of

OPTIMIZERS = Registry()  # every hvdp.keras DistributedOptimizer, in creation order
OUTER = Registry()  # every hvdp.keras OuterOptimizer, in creation order
# DistributedGradientTape (TF): one reducer per (arguments, sources), kept across traces
TAPE_REDUCERS = {}


def joined_cond(comm, all_active, some_joined):
    """``all_active()`` unless some rank has joined, then ``some_joined()``: decided in the graph
    from one allreduce of a 1 per rank (a joined rank adds the zero Horovod's join gives it)."""
    active = comm.wait(comm.allreduce_async(B.one(), CONTROL_NAME, SUM))
    return keras.ops.cond(active[0] > comm.size - 0.5, all_active, some_joined)


def _refuse_unless_ready():
    # a tape has no join control: its two-phase buckets refuse
    reducers = ([(state_of(opt), None) for opt in OPTIMIZERS.alive()]
                + [(red, "tape") for red in TAPE_REDUCERS.values()])
    for red, tape in reducers:
        why = red.engine.join_refusal("keras", tape)
        if why is not None:
            raise JoinRefused(why)
    for opt in OUTER.alive():
        why = outer_of(opt).join_refusal()
        if why is not None:
            raise JoinRefused(why)


def join(extra_variables=(), optimizers=None) -> int:
    """Horovod's ``join`` (this rank has run out of data; the others go on; returns once every
    rank has joined), made safe for hvdp's codecs.

    Every hvdp optimizer's variables (or those of ``optimizers`` when given), the trainable
    variables they update, and ``extra_variables`` are then broadcast from the last rank to
    join, so all ranks are identical. An optimizer whose join control is off while it has
    bf16/int8/int4/topk buckets (created with ``uneven_inputs=False`` or ``hierarchical=True``), or
    a ``DistributedGradientTape`` with such a codec, makes this raise
    :class:`hvdp.reduce.join.JoinRefused`, saying why.

    Example::

        for xb, yb in my_shard:        # ranks have different numbers of batches
            train_step(xb, yb)
        hvd.join()

    Returns:
        the rank that joined last.
    """
    gc.collect()  # an optimizer dropped earlier should not refuse or be broadcast below
    _refuse_unless_ready()
    last = B.horovod_join()
    # only those alive on every rank: no broadcast on some ranks only
    outers = OUTER.alive_on_every_rank(B.hvd.allgather_object, "hvdp.join.outer")
    given = optimizers if optimizers is not None else \
        OPTIMIZERS.alive_on_every_rank(B.hvd.allgather_object, "hvdp.join.alive")
    seen, variables = set(), []
    for opt in given:
        red = state_of(opt)
        if red is None or red.engine.comm.process_set.process_set_id != 0 or not opt.built:
            continue  # Horovod's join is global; an hvd.OuterOptimizer syncs below
        for v in list(getattr(opt, "_trainable_variables", [])) + list(opt.variables):
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
    for v in extra_variables:
        if id(v) not in seen:
            seen.add(id(v))
            variables.append(v)
    if variables and B.hvd.size() > 1:
        broadcast_variables(variables, root_rank=last)
    for opt in outers:  # hvd.OuterOptimizer: the last rank's parameters and outer state
        if optimizers is None or any(opt is o for o in optimizers):
            outer_of(opt).sync_from(last)
    return last


def has_join_callback(model) -> bool:
    """Was a :class:`JoinCallback` given this model (``fit`` may then run uneven steps)?"""
    return getattr(model, "_hvdp_join_callback", False)


class JoinCallback(keras.callbacks.Callback):
    """``model.fit`` on shards of different lengths: after its last batch of each epoch a rank
    joins, and the ranks with more batches finish theirs; then model and optimizer are broadcast
    from the last rank to join. It joins at the last batch's end, before validation and before
    any callback's ``on_epoch_end`` (``MetricAverageCallback``'s allreduce), so its place in the
    list does not matter; only when fit cannot tell the number of steps (a dataset of unknown
    length) does it join at ``on_epoch_end``, and must then come first. Every codec works with the
    optimizer's default ``uneven_inputs`` (not with ``uneven_inputs=False`` or ``hierarchical=True``
    and a two-phase codec: refused at ``fit``'s start).

    Example::

        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), compression="int8")
        model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()],
                  callbacks=[hvd.callbacks.JoinCallback(),
                             hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    """

    def set_model(self, model):
        super().set_model(model)
        model._hvdp_join_callback = True  # BroadcastGlobalVariablesCallback then allows uneven steps

    def on_train_begin(self, logs=None):
        if outer_of(self.model.optimizer) is not None:
            return  # hvd.OuterOptimizer: its syncs count the ranks taking part
        red = state_of(self.model.optimizer)
        if red is None:
            raise ValueError("hvd.callbacks.JoinCallback needs the model compiled with an hvdp.keras "
                             "DistributedOptimizer")
        why = red.engine.join_refusal("keras", planned=True)
        if why is not None:
            raise ValueError("hvd.callbacks.JoinCallback cannot work here: " + why)

    def on_epoch_begin(self, epoch, logs=None):
        self._joined = False

    def _join(self):
        if not self._joined:
            self._joined = True
            # this model's optimizer only: other optimizers alive in the process are not fit's
            join(extra_variables=self.model.variables, optimizers=[self.model.optimizer])

    def on_train_batch_end(self, batch, logs=None):
        steps = (self.params or {}).get("steps")
        if steps and batch + 1 >= steps:
            self._join()

    def on_epoch_end(self, epoch, logs=None):
        self._join()
