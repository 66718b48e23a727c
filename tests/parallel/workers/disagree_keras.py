"""Keras version of disagree_torch.py: two ranks that differ in one detail, 3 steps of fit.

Prints 'ERROR rank=<r> after=<s> type=<T> msg=<json>' for the exception that ends a rank and
lets it propagate, or 'DONE rank=<r>'.
"""
import os
import sys
import time

import keras
import numpy as np

import hvdp.keras as hvd
from case_report import run_and_report, run_cases, stalled_call


def model_for(case, rank):
    keras.utils.set_random_seed(0)
    hidden = 48 if (case.startswith("wider") and rank == 1) else 32
    layers = [keras.Input((2048,)), keras.layers.Dense(hidden, activation="tanh", name="hidden"),
              keras.layers.Dense(4, name="out")]
    if case.startswith("extra") and rank == 1:  # a layer built only on one rank
        layers.append(keras.layers.Dense(4, name="extra"))
    return keras.Sequential(layers)


class FailOnRank1(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if hvd.rank() == 1 and batch == 1:
            raise ValueError("injected failure: rank 1's callback broke")


class StallOnRank1(keras.callbacks.Callback):
    """Rank 1 sleeps before its second step (a long evaluation on one rank only)."""

    def on_train_batch_begin(self, batch, logs=None):
        if hvd.rank() == 1 and batch == 1:
            time.sleep(float(os.environ.get("STALL_S", "120")))


CALLBACKS = {"fail_callback": FailOnRank1, "stall": StallOnRank1}


def caught_error(model, x, y):
    """A step that fails on the user's own error (labels out of range, on every rank), caught;
    then evaluate for IDLE_S (no reduction), make one TF call that lasts IDLE_S (a graph loop)
    and train on: nothing may call that a stall."""
    import tensorflow as tf

    from hvdp.keras import _backend_tf as tfb
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    try:
        model.fit(x, y + 4, batch_size=8, epochs=1, verbose=0)
        raise AssertionError("labels out of range did not fail the step")
    except Exception as e:  # TF's InvalidArgumentError
        assert "label" in str(e).lower(), e
    begun, ended = tfb._WATCH["v"]
    gap = int(begun.numpy()) - int(ended.numpy())
    if gap == 0:  # TF ran the count before the failing op in every run seen; if not, leave it as that would
        begun.assign_add(1)
    print(f"GAP rank={hvd.rank()} after_failure={gap}", flush=True)
    t = time.monotonic()
    while time.monotonic() - t < float(os.environ["IDLE_S"]):
        model.evaluate(x, y, batch_size=8, verbose=0)

    @tf.function
    def one_long_call(seconds):
        t0 = tf.timestamp()
        return tf.while_loop(lambda n: tf.timestamp() - t0 < seconds, lambda n: n + 1, [tf.constant(0)])

    t = time.monotonic()
    one_long_call(tf.constant(float(os.environ["IDLE_S"]), tf.float64))
    print(f"LONG_CALL rank={hvd.rank()} took={time.monotonic() - t:.1f}s", flush=True)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def run(case, rank):
    if case == "stall_user":  # rank 1 never reaches the script's own hvd.allreduce
        return stalled_call(rank, lambda: hvd.allreduce(np.ones(1, "float32"), name="user.loss"))
    model = model_for(case, rank)
    x = np.random.default_rng(0).standard_normal((24, 2048)).astype("float32")
    y = np.arange(24) % 4
    if case == "broadcast":
        extra = [keras.Variable(np.zeros(3, "float32"), name="extra")] if rank == 1 else []
        hvd.broadcast_variables(list(model.variables) + extra, root_rank=0)
        return
    kw = {"compression": "int8" if case.endswith("int8") else "none"}
    if rank == 1 and case == "codec":
        kw["compression"] = "int8"
    if rank == 1 and case == "bpps":
        kw["backward_passes_per_step"] = 2
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kw)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if case == "caught_error":
        return caught_error(model, x, y)
    if case == "stall_agree":  # rank 1 never reaches fit, where the ranks-agree check runs
        return stalled_call(rank, lambda: model.fit(x, y, batch_size=8, epochs=1, verbose=0))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[CALLBACKS[case]()] if case in CALLBACKS else [])


def main():
    case = sys.argv[1]
    hvd.init()
    if case == "cases":  # disagree_keras.py cases <case> <case> ...: one job, each case reported
        barrier = iter(range(1 << 30))
        run_cases(run, sys.argv[2:], hvd.rank(),
                  lambda: hvd.allreduce(np.zeros(1, "float32"), name=f"cases.barrier.{next(barrier)}"))
        return
    run_and_report(run, case, hvd.rank())


if __name__ == "__main__":
    main()
