"""The main job for Keras 3: digits, data-parallel with hvdp.keras (same data and output as
examples/torch_digits.py), on Keras' TensorFlow or torch backend.

    horovodrun -np 2 -H localhost:2 python examples/keras_digits.py --compression int8
    KERAS_BACKEND=torch horovodrun -np 2 -H localhost:2 python examples/keras_digits.py
"""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hvdp.keras as hvd  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05, help="for one worker; scaled by size")
    p.add_argument("--compression", default="none", help="none, fp16, bf16, int8, topk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out")
    args = p.parse_args(argv)

    hvd.init()
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    else:
        import torch
        torch.set_num_threads(1)
    keras.utils.set_random_seed(args.seed)
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split((x / 16.0).astype("float32"), y, test_size=0.25,
                                          random_state=0, stratify=y)
    # every rank: its own shard (the same shard size on all ranks, so all take the same steps)
    n = len(xtr) // (hvd.size() * args.batch_size) * hvd.size() * args.batch_size
    order = np.random.RandomState(args.seed).permutation(len(xtr))[:n]
    mine = order[hvd.rank()::hvd.size()]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9),
                                   compression=args.compression)
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    t0 = time.perf_counter()
    model.fit(xtr[mine], ytr[mine], batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)
    elapsed = time.perf_counter() - t0
    _, acc = model.evaluate(xte, yte, verbose=0)
    rate = float(keras.ops.convert_to_numpy(hvd.allreduce(
        keras.ops.convert_to_tensor(np.array([len(mine) * args.epochs / elapsed], "float32")),
        op=hvd.Sum, name="rate"))[0])
    stats = opt.compression_stats()
    if hvd.rank() == 0:
        print(f"test accuracy {acc:.4f}  |  {rate:.0f} samples/s over {hvd.size()} worker(s) "
              f"({keras.backend.backend()})  |  "
              f"compression {stats['codec']}: wire bytes {stats['total']['all']['ratio']:.3f} of float32", flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"test_accuracy": float(acc), "samples_per_s": float(rate), "size": hvd.size(),
                       "backend": keras.backend.backend(),
                           "codec": stats["codec"], "wire_ratio": stats["total"]["all"]["ratio"]}, f)


if __name__ == "__main__":
    main()
