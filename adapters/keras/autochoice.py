"""``compression="auto"`` in hvdp.keras: one codec for the whole model, chosen when the reducer
is built (and built again: a layer frozen or unfrozen), from the core's probe and cost model.

Unlike hvdp.torch (a codec per bucket, a trial of the first steps, a new probe after an elastic
reset) the Keras reducer runs one codec inside the traced train step, so the choice is made
once, eagerly, before the step is traced: ``hvdp.auto.decide_uniform`` over the buckets a
two-phase codec would use. The probe runs the backend's array ops eagerly (TensorFlow: slower
per op than the traced step), which errs towards less compression.
"""
import time

from hvdp.auto import CostTable, decide_uniform
from hvdp.plan import make_plan
from hvdp.probe import measure
from hvdp.twophase import TwoPhaseReducer

from .agreement import allgather_fixed, check_reducer
from .backend import BACKEND as B


def choose(reducer, settings, floating):
    """The codec ``reducer`` will run for its variables; its figures go to ``reducer.auto``."""
    plan = make_plan(reducer.names, reducer.numels, floating, reducer.policy, True)
    buckets = {f"b{b}": sum(reducer.numels[i] for i in idx) for b, idx in enumerate(plan.buckets)}
    p = reducer.comm.size
    pol = reducer.policy

    def make(codec, comm):
        ef = codec.error_feedback_default if pol.error_feedback is None else pol.error_feedback
        return TwoPhaseReducer(codec, B.ops, comm, ef, reducer.op, reducer.predivide)

    # the ranks agree on the setting and the layout before the probe's collectives (a rank with
    # another codec would not probe: without this, the others would wait for it)
    reducer.plan = plan
    check_reducer(reducer, reducer.variables, at_build=True)
    t0, probed = time.perf_counter(), False
    if settings.costs is not None:
        table = settings.costs
    elif p <= 1 or not buckets:
        table = CostTable(p)
    else:
        with B.init_scope():  # eager, also while a train step is being traced
            table = measure(reducer.comm, B.ops, None, list(buckets.values()), settings.candidates,
                            make, allgather_fixed(reducer.comm.process_set))
        probed = True
    codec, total = decide_uniform(buckets, settings.candidates, table, settings.margin)
    reducer.auto = {"settings": str(settings), "codec": str(codec), "buckets": buckets,
                    "predicted_ms": {k: 1e3 * v for k, v in total.items()},
                    "costs": table.as_dict(), "probe_wall_s": time.perf_counter() - t0 if probed else 0.0}
    return codec
