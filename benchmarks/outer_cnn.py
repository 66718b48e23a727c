"""Outer steps on a second model (issue 35): does what the GPT showed hold for the CNN?

The GPT of outer_tta.py / outer_warmup.py / outer_horizon.py (inner AdamW) ends 1.17-1.31 x fp32
data parallelism's held-out loss with DiLoCo's outer SGD and no warm-up, 0.98 after W = 96
synchronous steps, and 1.03-1.06 with parameter averaging. This stage runs the same outer
configurations on examples/torch_cnn.py (conv + batch norm on the digits images, inner SGD with
momentum 0.9, lr 0.05 per worker with cosine decay, batch 32 per worker; then the same with an
inner AdamW, lr 3e-3 per worker), 2 workers, 248 steps
(the last one a sync for W = 0 and W = 96 at H = 8), 3 seeds, in one horovodrun job on the
loopback (the loss does not depend on the link):

    python benchmarks/outer_cnn.py [--seeds 0 1 2]   # -> results/outer_cnn.{json,md}

``--model digits``: a third model, the main job's MLP (examples/torch_digits.py: two hidden layers of
256, no batch norm; inner SGD with momentum 0.9, lr 0.05 per worker, batch 32 per worker), 8
epochs = 168 steps (a sync for W = 0 and W = 96), the inner-SGD rows only
(-> results/outer_digits.{json,md}).

Rows: fp32 data parallelism (hvdp none), int8 every step, and hvdp.OuterOptimizer at H = 8 with
int8 pseudo-gradients: DiLoCo's outer SGD (hvdp's default: Nesterov, lr 0.7, momentum 0.9) and
parameter averaging (outer lr 1, no momentum), each with W = 0 and W = 96; each row's loss ÷
fp32 DP's with the same inner optimizer.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RES = os.path.join(HERE, "results")
BASE = ["--epochs", "12", "--max-steps", "248", "--batch-size", "32", "--quiet"]
OUTER = ["--compression", "int8", "--sync-every", "8"]
AVERAGING = ["--outer-lr", "1", "--outer-momentum", "0"]
ADAMW = ["--optimizer", "adamw", "--lr", "3e-3"]  # per worker (the example scales it by the size)
DIGITS_BASE = ["--epochs", "8", "--quiet"]  # 21 steps an epoch: 168 = 96 + 9 x 8
FP32 = "fp32 DP (hvdp none)"
CONFIGS = [
    (FP32, ["--compression", "none"]),
    ("hvdp int8, every step", ["--compression", "int8"]),
    ("DiLoCo H8 int8, W = 0", OUTER + ["--warmup-steps", "0"]),
    ("DiLoCo H8 int8, W = 96", OUTER + ["--warmup-steps", "96"]),
    ("averaging H8 int8, W = 0", OUTER + AVERAGING + ["--warmup-steps", "0"]),
    ("averaging H8 int8, W = 96", OUTER + AVERAGING + ["--warmup-steps", "96"]),
    # the same with an inner AdamW (appended: the rows above keep their files' indexes)
    ("AdamW: " + FP32, ADAMW + ["--compression", "none"]),
    ("AdamW: DiLoCo H8 int8, W = 0", ADAMW + OUTER + ["--warmup-steps", "0"]),
    ("AdamW: DiLoCo H8 int8, W = 96", ADAMW + OUTER + ["--warmup-steps", "96"]),
    ("AdamW: averaging H8 int8, W = 0", ADAMW + OUTER + AVERAGING + ["--warmup-steps", "0"]),
    ("AdamW: averaging H8 int8, W = 96", ADAMW + OUTER + AVERAGING + ["--warmup-steps", "96"]),
]


def selected(o):
    """CONFIGS for the options ``o`` (main()'s): with ``o.sgd_lr`` (or the digits MLP, which has
    no --optimizer) the rows with an inner SGD only, at that lr per worker; with ``o.bn_refresh``
    every run recomputes its batch-norm statistics before each evaluation; with ``o.clip`` every
    run clips its gradients' norm."""
    rows = CONFIGS if o.sgd_lr is None and o.model == "cnn" else [
        (label, (["--lr", f"{o.sgd_lr:g}"] if o.sgd_lr is not None else []) + args) for label, args in CONFIGS
        if not label.startswith("AdamW")]
    extra = (["--bn-refresh"] if o.bn_refresh else []) + (["--clip", f"{o.clip:g}"] if o.clip else [])
    return [(label, args + extra) for label, args in rows]


def worker(o):
    """Inside horovodrun: every (configuration, seed) run in turn, one JSON file each."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    if o.model == "digits":
        from torch_digits import main
    else:
        from torch_cnn import main
    base = DIGITS_BASE if o.model == "digits" else BASE
    for i, (_, args) in enumerate(selected(o)):
        for s in o.seeds:
            main(base + args + ["--seed", str(s), "--json-out", os.path.join(o.out_dir, f"{i}-{s}.json")])


def run(o, out_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    cmd = ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, os.path.abspath(__file__),
           "--worker", "--out-dir", out_dir, "--model", o.model, "--clip", f"{o.clip:g}",
           "--seeds"] + [str(s) for s in o.seeds]
    if o.sgd_lr is not None:
        cmd += ["--sgd-lr", f"{o.sgd_lr:g}"]
    if o.bn_refresh:
        cmd += ["--bn-refresh"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if r.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-3000:]}")
    runs = {label: [json.load(open(os.path.join(out_dir, f"{i}-{s}.json"))) for s in o.seeds]
            for i, (label, _) in enumerate(selected(o))}
    return runs, time.time() - t0


def report(runs, took, o):
    first = runs[FP32][0]
    what = "the MLP (examples/torch_digits.py)" if o.model == "digits" else "the CNN (examples/torch_cnn.py)"
    lines = [f"Outer steps on {what}, 2 workers, {first['steps']} steps of global batch "
             f"{first['global_batch']}, seeds {[r['seed'] for r in runs[FP32]]}, loopback; the run took "
             f"{took / 60:.1f} min. Inner SGD with momentum 0.9 (lr {o.sgd_lr or 0.05:g} per worker). "
             + ("The rows 'AdamW:' an inner AdamW (lr 3e-3 per worker), ÷ fp32 DP's with AdamW. "
                if any(label.startswith("AdamW") for label in runs) else "")
             + ("Batch-norm statistics recomputed from the training set before the evaluation (--bn-refresh). "
                if o.bn_refresh else "")
             + (f"Every run clips its gradients' norm at {o.clip:g}. " if o.clip else "")
             + "Test loss and accuracy at the last step (a "
             "sync for every outer row: the ranks' largest difference in the last column).", "",
             "| method | test loss, mean (per seed) | ÷ fp32 DP's (mean of per-seed ratios) | test accuracy, mean "
             "(per seed) | wire bytes ÷ fp32 per step | ranks differ by |", "|---|---|---|---|---|---|"]
    for label, rs in runs.items():
        base = runs["AdamW: " + FP32 if label.startswith("AdamW") else FP32]  # the same inner optimizer's
        loss = [r["test_loss"] for r in rs]
        ratio = statistics.mean(r["test_loss"] / b["test_loss"] for r, b in zip(rs, base))
        acc = [r["test_accuracy"] for r in rs]
        lines.append(f"| {label} | {statistics.mean(loss):.4f} ({', '.join(f'{v:.4f}' for v in loss)}) "
                     f"| {ratio:.3f} | {statistics.mean(acc):.4f} ({', '.join(f'{v:.4f}' for v in acc)}) "
                     f"| {statistics.mean(r['wire_ratio'] for r in rs):.3f} "
                     f"| {max(r['ranks_max_diff'] for r in rs):.3g} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out-dir", default=None, help="the runs' JSON files (default: a temporary directory)")
    ap.add_argument("--sgd-lr", type=float, default=None, help="only the inner-SGD rows, at this lr per worker "
                    "(the example's: 0.05) -> results/outer_cnn_sgd<lr>.{json,md}")
    ap.add_argument("--bn-refresh", action="store_true", help="every run recomputes its batch-norm statistics "
                    "before evaluating -> results/outer_cnn[_sgd<lr>]_bnrefresh.{json,md}")
    ap.add_argument("--model", choices=("cnn", "digits"), default="cnn", help="digits: the main job's MLP, "
                    "inner SGD rows only -> results/outer_digits.{json,md}")
    ap.add_argument("--clip", type=float, default=0.0, help="with --model digits: every run clips its gradients' "
                    "norm at this value, as the GPT does at 1.0 -> results/outer_digits_clip<X>.{json,md}")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.model == "digits" and a.bn_refresh:
        ap.error("--bn-refresh: the digits MLP has no batch norm")
    if a.clip and a.model != "digits":
        ap.error("--clip: only with --model digits (torch_cnn.py does not clip)")
    if a.worker:
        return worker(a)
    import tempfile
    out_dir = a.out_dir or tempfile.mkdtemp(prefix=f"outer_{a.model}-")
    runs, took = run(a, out_dir)
    md = report(runs, took, a)
    print(md)
    os.makedirs(RES, exist_ok=True)
    stem = os.path.join(RES, f"outer_{a.model}" + ("" if a.sgd_lr is None else f"_sgd{a.sgd_lr:g}")
                        + ("_bnrefresh" if a.bn_refresh else "") + (f"_clip{a.clip:g}" if a.clip else ""))
    with open(stem + ".json", "w") as f:
        json.dump({"took_s": took, "args": DIGITS_BASE if a.model == "digits" else BASE,
                   "configs": selected(a), "runs": runs}, f)
    with open(stem + ".md", "w") as f:
        f.write(md)


if __name__ == "__main__":
    main()
