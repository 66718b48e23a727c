"""compression="auto" in hvdp.keras on real workers (KERAS_BACKEND: tensorflow or torch). Prints
'CHECK <name> OK rank=<r>' per passed check; a failed check raises, which fails the job."""
import hashlib
import json
import sys

import keras
import numpy as np

import hvdp.keras as hvd
from hvdp.cluster.agreement import DisagreementError
from hvdp.reduce.auto import CostTable, Line

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from keras_checks import LOSS, allgathered, data, shard  # noqa: E402


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(256, activation="tanh"),
                             keras.layers.Dense(256, activation="tanh"), keras.layers.Dense(3)])


def fit(compression, seed=0):
    x, y = data(128)
    xs, ys = shard(x, y, 8)
    model = make_model(seed)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression,
                                   policy=hvd.CompressionPolicy(min_elements=1))
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model, opt


def same_on_every_rank(obj, what):
    digest = np.frombuffer(hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).digest(), np.uint8)
    rows = allgathered(digest, f"auto.same.{what}")
    assert all(np.array_equal(r, rows[0]) for r in rows), f"{what} differs between ranks: {obj}"


def assert_same_weights(a, b, what):
    for i, (u, v) in enumerate(zip(a.get_weights(), b.get_weights())):
        assert np.array_equal(u, v), f"{what}: weight {i} differs (max |diff| {np.abs(u - v).max():.3g})"


def decision(auto):
    return {b["bucket"]: b["codec"] for b in auto["buckets"]}


def single(auto):
    """The one codec every bucket runs (the model here fuses into one bucket)."""
    codecs = set(decision(auto).values())
    assert len(codecs) == 1, auto
    return codecs.pop()


def check_probe():
    """A real probe (no trial): every rank runs the same codec, and training equals the fixed codec's."""
    model, opt = fit(hvd.Compression.auto.configure(trial_steps=0))
    auto = opt.compression_stats()["auto"]
    # per bucket where Keras runs the step eagerly (torch backend), one codec before tracing (TF)
    assert auto["per_bucket"] == (keras.backend.backend() == "torch"), auto
    same_on_every_rank({"decision": decision(auto), "costs": auto["costs"]}, "decision")
    if hvd.rank() == 0:
        print(f"  chose {decision(auto)}; probe {1e3 * auto['probe_wall_s']:.0f} ms", flush=True)
    twin, _ = fit(single(auto).split("(")[0])
    assert_same_weights(model, twin, f"auto ({single(auto)}) vs fixed")


def check_trial():
    """The default auto (probe, then the trial where the step is eager): every rank ends with the
    same decision; on the torch backend, one of the plans tried."""
    x, y = data(128)
    xs, ys = shard(x, y, 8)
    model = make_model(2)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="auto",
                                   policy=hvd.CompressionPolicy(min_elements=1))
    model.compile(optimizer=opt, loss=LOSS)
    k = hvd.Compression.auto.trial_steps
    model.fit(xs, ys, batch_size=8, epochs=-(-(3 * k + 4) // (len(xs) // 8)), shuffle=False, verbose=0)
    auto = opt.compression_stats()["auto"]
    assert auto["decided"], auto
    same_on_every_rank({"decision": decision(auto), "trial": auto["trial"], "proposal": auto["proposal"]},
                       "trial")
    if keras.backend.backend() == "torch" and any(not c.startswith("none") for c in auto["proposal"].values()):
        assert auto["trial"] is not None, auto
        assert auto["trial"]["plans"][auto["trial"]["kept"]] == decision(auto), auto
    if hvd.rank() == 0:
        print(f"  proposal {auto['proposal']}, trial {auto['trial']}, kept {decision(auto)}", flush=True)


def check_forced():
    """A given table under which int8 wins: no probe, and int8's training exactly."""
    links = {k: Line(1e-4, 1e-6) for k in ("allreduce.float32", "allreduce.float16", "alltoall", "allgather")}
    table = CostTable(hvd.size(), links, {"int8(block_size=256)": Line(0, 1e-12)})
    model, opt = fit(hvd.Compression.auto.configure(candidates=("int8",), costs=table))
    auto = opt.compression_stats()["auto"]
    assert single(auto) == "int8(block_size=256)" and auto["probe_wall_s"] == 0.0, auto
    assert opt.compression_stats()["codec"].startswith("auto("), opt.compression_stats()["codec"]
    twin, _ = fit("int8")
    assert_same_weights(model, twin, "forced int8 vs fixed int8")


def check_disagreement():
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="auto" if hvd.rank() == 0 else "int8")
    try:
        opt.build(model.trainable_variables)
    except DisagreementError as e:
        assert "auto(" in str(e), str(e)
    else:
        raise AssertionError("auto on one rank and int8 on the other were not refused")


CHECKS = {"probe": check_probe, "trial": check_trial, "forced": check_forced,
          "disagreement": check_disagreement}

if __name__ == "__main__":
    hvd.init()
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name]()
        print(f"CHECK {name} OK rank={hvd.rank()}", flush=True)
