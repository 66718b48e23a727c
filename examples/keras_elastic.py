"""Elastic data-parallel training on digits with Keras 3: survives workers dying, joining, leaving.

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script ./discover.sh --gloo \
        python examples/keras_elastic.py --compression int8

Same audit log as examples/torch_elastic.py with ``--log-dir``. Runs on Keras's TensorFlow backend
(the step traced by tf.function) and its torch backend (``KERAS_BACKEND=torch``: the step eager,
as Keras's own torch trainer does it).

With ``--outer-every H``, outer steps (``hvd.OuterOptimizer``: DiLoCo, inner SGD with a fixed lr)
instead of a gradient exchange every step, as in examples/torch_elastic.py: every commit carries
the outer state, after a reset every worker restarts from the global parameters, and the model
evaluated at the end is the global one. ``--die-at N`` (tests): the worker on ``--die-host``
kills itself (SIGKILL) right after committing step N.
"""
import argparse
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hvdp.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_audit import AuditLog, digest, end_step  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=0.02, help="per worker; scaled by the current size")
    p.add_argument("--compression", default="int8")
    p.add_argument("--log-dir")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--outer-every", type=int, default=0, help="H: outer steps every H inner steps (0: off)")
    p.add_argument("--warmup-steps", type=int, default=0, help="W: synchronous steps before the outer steps")
    p.add_argument("--die-at", type=int, default=0, help="commit after which the worker on --die-host dies")
    p.add_argument("--die-host", default="127.0.0.1")
    args = p.parse_args()
    dies = args.die_at and os.environ.get("HOROVOD_HOSTNAME") == args.die_host

    hvd.init()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    else:
        import torch
        torch.set_num_threads(1)
    keras.utils.set_random_seed(0)
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split((x / 16.0).astype("float32"), y, test_size=0.25,
                                          random_state=0, stratify=y)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    if args.outer_every:  # inner steps are local: their lr does not scale with the workers
        opt = hvd.OuterOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9), sync_every=args.outer_every,
                                 compression=args.compression, warmup_steps=args.warmup_steps)
    else:
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9),
                                       compression=args.compression)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    sampler = hvd.elastic.ElasticSampler(len(xtr), args.batch_size, seed=0)
    state = hvd.elastic.KerasState(model, opt, sampler=sampler, epoch=0, commits=0)
    log = AuditLog(args.log_dir)

    def outer_record():
        loop = opt.outer if args.outer_every else None
        if loop is None:
            return None
        return {"outer": {"step": loop.step, "outer_steps": list(loop.outer_steps),
                          "globals": digest([keras.ops.convert_to_numpy(g) for g in loop.globals])}}

    @hvd.elastic.run
    def train(state):
        if not args.outer_every:
            opt.learning_rate.assign(args.lr * hvd.size())
        step = make_step(model, opt, loss_fn)  # made here: traced again after every reset (TF)

        while state.epoch < args.epochs:
            for idx in state.sampler:
                # a rank without samples in the last step still takes part, with zero weight
                xb, yb, w = (xtr[idx], ytr[idx], np.ones(len(idx), "float32")) if idx else \
                    (xtr[:1], ytr[:1], np.zeros(1, "float32"))
                loss_sum = float(step(xb, yb, w))
                block = hvd.allgather_object((list(map(int, idx)), loss_sum))
                end_step(state, block, hvd.size(), log, args.step_sleep, outer_record(), hvd.rank())
                if dies and state.commits == args.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if args.outer_every:  # the global parameters (the inner steps since the last sync are local)
        for v, g in zip(model.trainable_variables, opt.outer.globals):
            v.assign(keras.ops.cast(g, v.dtype))
    out = model.predict(xte, verbose=0)
    acc = float(np.mean(np.argmax(out, 1) == yte))
    test_loss = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(yte, out))
    log.final(model.get_weights(), hvd.size(), acc, test_loss=test_loss, **(outer_record() or {}))
    if hvd.rank() == 0:
        print(f"done: {args.epochs} epochs, {state.commits} committed steps, {hvd.size()} workers at the end, "
              f"test accuracy {acc:.4f}, test loss {test_loss:.4f}", flush=True)


def make_step(model, opt, loss_fn):
    """One update on (x, y, per-sample weights) -> the batch's loss sum, on either backend."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        @tf.function  # the layout follows the size: a new trace after every reset
        def step(xb, yb, w):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True), sample_weight=w) / tf.maximum(tf.reduce_sum(w), 1.0)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss * tf.reduce_sum(w)
        return step
    import torch

    def step(xb, yb, w):
        xb, yb, w = (keras.ops.convert_to_tensor(a) for a in (xb, yb, w))
        model.zero_grad()
        loss = loss_fn(yb, model(xb, training=True), sample_weight=w) / torch.clamp(w.sum(), min=1.0)
        loss.backward()
        variables = model.trainable_variables
        with torch.no_grad():
            opt.apply([v.value.grad for v in variables], variables)
        return (loss * w.sum()).detach()
    return step


if __name__ == "__main__":
    main()
