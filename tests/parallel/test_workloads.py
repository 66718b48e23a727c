"""The workload examples (torch CNN, torch GPT, Keras CNN) run a few steps at -np 2: the loss
falls, every rank ends with the same model, and int8 stays near the uncompressed run.

One horovodrun job per example (tests/parallel/workers/workload_runs.py runs none and int8 in
it); the convergence study itself (benchmarks/convergence.py) is not part of `make test`.
"""
import functools
import json
import os
import statistics

import pytest

from conftest import WORKERS, horovodrun

pytestmark = pytest.mark.parallel

# int8 (+ error feedback) against float32 on the same seed and steps: mean training loss over
# the run, relative; a few dozen steps of a small model leave room for codec noise
CURVE_TOLERANCE = 0.10


@functools.lru_cache(maxsize=None)
def run_example(name, tmp_root):
    out = os.path.join(tmp_root, name)
    os.makedirs(out, exist_ok=True)
    rc, log = horovodrun([os.path.join(WORKERS, "workload_runs.py"), name, out], timeout=900)
    assert rc == 0, f"{name} failed (rc={rc}):\n{log[-4000:]}"
    results = {}
    for f in os.listdir(out):
        if f.endswith(".json"):
            with open(os.path.join(out, f)) as fh:
                results[f[len(name) + 1:-5]] = json.load(fh)
    return results


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("workloads"))


def head_tail(curve, k):
    return statistics.mean(curve[:k]), statistics.mean(curve[-k:])


@pytest.mark.parametrize("name,k", [("torch_cnn", 5), ("torch_gpt", 4), ("keras_cnn", 1)])
def test_example_trains_identically_on_every_rank(name, k, tmp_root):
    results = run_example(name, tmp_root)
    assert {"none", "int8"} <= set(results), sorted(results)
    for codec in ("none", "int8"):
        r = results[codec]
        assert r["size"] == 2
        assert r["ranks_max_diff"] == 0.0, f"{name} {codec}: ranks differ by {r['ranks_max_diff']}"
        first, last = head_tail(r["train_curve"], k)
        assert last < 0.9 * first, f"{name} {codec}: loss {first:.4f} -> {last:.4f} did not fall"
    assert results["int8"]["wire_ratio"] < 0.5, results["int8"]["wire_ratio"]
    base, int8 = (statistics.mean(results[c]["train_curve"]) for c in ("none", "int8"))
    assert abs(int8 / base - 1) <= CURVE_TOLERANCE, f"{name}: mean loss none {base:.4f}, int8 {int8:.4f}"


def test_cnn_through_outer_steps(tmp_root):
    """The examples' --sync-every: hvd.OuterOptimizer (int8 pseudo-gradients, H = 4, 8 warm-up
    steps) trains the CNN; after the last step (a sync) every rank holds the same model, and a
    step sends a quarter of an int8 step's bytes on average."""
    results = run_example("torch_cnn", tmp_root)
    outer, int8 = results["outer"], results["int8"]
    assert outer["codec"].startswith("H=4 ") and "W=8" in outer["codec"], outer["codec"]
    assert outer["steps"] == 28 and outer["ranks_max_diff"] == 0.0, (outer["steps"], outer["ranks_max_diff"])
    first, last = head_tail(outer["train_curve"], 5)
    assert last < 0.9 * first, f"outer steps: loss {first:.4f} -> {last:.4f} did not fall"
    assert abs(outer["wire_ratio"] / (int8["wire_ratio"] / 4) - 1) < 0.05, (outer["wire_ratio"], int8["wire_ratio"])


def test_main_job_through_outer_steps(tmp_root):
    """examples/torch_digits.py --sync-every 6 (int8, 6 warm-up steps), in the CNN's job: 42 steps,
    the last a sync, every rank the same model, a test accuracy a trained model has, and 1/6 of an
    int8 step's bytes a step after the warm-up."""
    r = run_example("torch_cnn", tmp_root)["digits-outer"]
    assert r["codec"].startswith("H=6 ") and "W=6" in r["codec"], r["codec"]
    assert r["steps"] == 42 and r["ranks_max_diff"] == 0.0, (r["steps"], r["ranks_max_diff"])
    # untrained: accuracy 0.1, loss 2.3
    assert r["test_accuracy"] > 0.6 and r["test_loss"] < 1.2, (r["test_accuracy"], r["test_loss"])
    int8 = 0.2585  # int8 every step, this model: 0.258 of float32's bytes (make demo prints it)
    assert abs(r["wire_ratio"] / (int8 / 6) - 1) < 0.05, r["wire_ratio"]


def test_gpt_resumes_from_its_checkpoint(tmp_root):
    results = run_example("torch_gpt", tmp_root)
    full, resumed = results["int8"], results["resumed"]
    assert full["steps"] == 24 and resumed["steps"] == 36, (full["steps"], resumed["steps"])
    # only the third epoch ran after the resume: 12 steps, one evaluation, at step 36
    assert len(resumed["train_curve"]) == 12 and [e[0] for e in resumed["evals"]] == [36]
    assert resumed["ranks_max_diff"] == 0.0
    assert resumed["val_loss"] < full["evals"][0][1], (resumed["val_loss"], full["evals"])


def test_gpt_through_ddp_hooks(tmp_root):
    """The GPT's DDP path (the peers' comparison): plain DDP trains the same model as hvdp without
    compression (the same data, accumulation by no_sync, clipping; averaging a/2 + b/2 against
    (a + b)/2 is exact in float32 away from overflow and subnormals); PowerSGD rank 4 trains."""
    results = run_example("torch_gpt", tmp_root)
    ddp, ref, psgd = results["ddp"], results["none"], results["ddp-powersgd4"]
    assert ddp["codec"] == "ddp" and psgd["codec"] == "ddp+powersgd4"
    for r in (ddp, psgd):
        assert r["ranks_max_diff"] == 0.0 and r["steps"] == ref["steps"]
        first, last = head_tail(r["train_curve"], 4)
        assert last < 0.9 * first, f"{r['codec']}: loss {first:.4f} -> {last:.4f} did not fall"
    worst = max(abs(a / b - 1) for a, b in zip(ddp["train_curve"], ref["train_curve"]))
    assert worst <= 1e-5, f"DDP plain and hvdp none differ by {worst:.3g} (relative, per step)"
    assert abs(ddp["val_loss"] / ref["val_loss"] - 1) <= 1e-5, (ddp["val_loss"], ref["val_loss"])
    assert psgd["wire_ratio"] < 0.2, psgd["wire_ratio"]
