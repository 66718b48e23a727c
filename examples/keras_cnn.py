"""The CNN of examples/torch_cnn.py for Keras 3, data-parallel through hvdp.keras and its
callbacks: a small conv net with batch norm on the bundled digits images, one-pixel shifts as
augmentation (keras.layers.RandomTranslation), any codec.

    horovodrun -np 2 -H localhost:2 python examples/keras_cnn.py --compression int8

Callbacks: BroadcastGlobalVariablesCallback (rank 0's start on every rank), MetricAverageCallback
(epoch metrics averaged over the ranks), LearningRateWarmupCallback (lr ramps up to lr x size),
and with --checkpoint hvd.callbacks.ModelCheckpoint (rank 0 writes, residuals kept). Batch-norm
moving statistics are averaged over the ranks before evaluation.
"""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdp.keras as hvd  # noqa: E402
from workload_data import digits_images  # noqa: E402


def make_model(width=32, seed=0):
    def block(x, c):
        x = keras.layers.Conv2D(c, 3, padding="same", use_bias=False)(x)
        return keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.9)(x))  # torch: 0.1
    inp = keras.Input((8, 8, 1))
    x = keras.layers.RandomTranslation(1 / 8, 1 / 8, fill_mode="constant", seed=seed)(inp)
    x = keras.layers.MaxPooling2D(2)(block(block(x, width), 2 * width))
    x = keras.layers.GlobalAveragePooling2D()(block(x, 2 * width))
    return keras.Model(inp, keras.layers.Dense(10)(x))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05, help="for one worker; scaled by size")
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--compression", default="none", help="none, fp16, bf16, int8, topk")
    p.add_argument("--checkpoint", help="a .keras file written after every epoch (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out")
    args = p.parse_args(argv)

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(args.seed + hvd.rank())  # each rank its own shifts
    xtr, ytr, xte, yte = (a.transpose(0, 2, 3, 1) if a.ndim == 4 else a for a in digits_images())
    n = len(xtr) // (hvd.size() * args.batch_size) * hvd.size() * args.batch_size
    mine = np.random.RandomState(args.seed).permutation(len(xtr))[:n][hvd.rank()::hvd.size()]

    model = make_model(args.width, args.seed)
    lr = args.lr * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9), compression=args.compression)
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=args.warmup_epochs)]
    if args.checkpoint:
        callbacks.append(hvd.callbacks.ModelCheckpoint(args.checkpoint))
    t0 = time.perf_counter()
    hist = model.fit(xtr[mine], ytr[mine], batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
                     callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)
    elapsed = time.perf_counter() - t0
    for v in model.non_trainable_variables:  # batch-norm moving statistics: the ranks' mean
        v.assign(hvd.allreduce(v.value, op=hvd.Average, name="bn." + v.path.replace("/", ".")))
    flat = np.concatenate([np.ravel(w) for w in model.get_weights()])
    diff = max(hvd.allgather_object(float(np.max(np.abs(flat - hvd.broadcast_object(flat, 0))))))
    test_loss, acc = model.evaluate(xte, yte, verbose=0)
    stats = opt.compression_stats()
    if hvd.rank() == 0:
        rate = len(mine) * args.epochs * hvd.size() / elapsed
        print(f"test accuracy {acc:.4f}  test loss {test_loss:.4f}  |  {rate:.0f} samples/s over {hvd.size()} "
              f"worker(s)  |  compression {stats['codec']}: "
              f"wire bytes {stats['total']['all']['ratio']:.3f} of float32  |  "
              f"ranks differ by {diff:.3g}", flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"test_accuracy": float(acc), "test_loss": float(test_loss), "size": hvd.size(),
                           "train_curve": [float(v) for v in hist.history["loss"]], "codec": stats["codec"],
                           "wire_ratio": stats["total"]["all"]["ratio"], "ranks_max_diff": diff}, f)


if __name__ == "__main__":
    main()
