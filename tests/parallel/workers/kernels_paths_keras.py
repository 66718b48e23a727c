"""hvdp.keras through the fused CPU codec kernels and through the array ops: the same bits.

TensorFlow backend with ``run_eagerly=True``: the kernels run on host copies of the eager tensors
(path "cpu-c (host copies)"); torch backend: on the tensors themselves ("cpu-c"). Each rank trains
the same model for a few steps on its half of a global batch with int8 + error feedback and with
bf16, once with HVDP_KERNELS=auto and once with HVDP_KERNELS=off; the weights must be
bit-identical, and within a stated tolerance of the same training with compression="none".
Prints 'CHECK <name> OK rank=<r>'.
"""
import os

import keras
import numpy as np

import hvdp.keras as hvd

STEPS = 6
EXPECTED = "cpu-c (host copies)" if keras.backend.backend() == "tensorflow" else "cpu-c"


def train(compression, kernels):
    os.environ["HVDP_KERNELS"] = kernels
    keras.utils.set_random_seed(0)
    # odd sizes: buckets whose chunks need padding
    model = keras.Sequential([keras.Input((37,)), keras.layers.Dense(301, activation="tanh"),
                              keras.layers.Dense(5)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    rng = np.random.RandomState(99)
    x, y = rng.randn(64, 37).astype("float32"), rng.randint(0, 5, 64)
    per = 64 // hvd.size()
    xs, ys = x[hvd.rank() * per:(hvd.rank() + 1) * per], y[hvd.rank() * per:(hvd.rank() + 1) * per]
    model.fit(xs, ys, batch_size=per // 4, epochs=1, shuffle=False, verbose=0)  # 4 steps
    model.fit(xs[:per // 2], ys[:per // 2], batch_size=per // 4, epochs=1, shuffle=False, verbose=0)  # 2 more
    return [np.array(w) for w in model.get_weights()], opt.compression_stats()


def main():
    hvd.init()
    base, _ = train("none", "off")
    for name, tol in (("int8", 2e-2), ("bf16", 2e-2)):
        fast, s_fast = train(name, "auto")
        slow, s_slow = train(name, "off")
        assert s_fast["paths"] == {name: EXPECTED}, s_fast["paths"]
        assert s_slow["paths"] == {name: "array ops"}, s_slow["paths"]
        for a, b, c in zip(fast, slow, base):
            assert np.array_equal(a.view(np.int32), b.view(np.int32)), f"{name}: kernel path differs"
            err = float(np.max(np.abs(a - c)))
            assert err <= tol, f"{name}: max |weight - uncompressed weight| {err:.3g} > {tol}"
        moved = max(float(np.max(np.abs(a - c))) for a, c in zip(fast, base))
        print(f"CHECK keras_kernels_{name} OK rank={hvd.rank()} backend={keras.backend.backend()} "
              f"path={s_fast['paths'][name]!r} max|w - w_none|={moved:.2e}", flush=True)


if __name__ == "__main__":
    main()
