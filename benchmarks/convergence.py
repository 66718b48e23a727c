"""Convergence by compression on two workloads: the CNN (examples/torch_cnn.py, test accuracy)
and the byte-level GPT (examples/torch_gpt.py, held-out loss); 2 workers, the same seeds, global
batch and steps for every codec.

    python benchmarks/convergence.py [--seeds 0 1 2] [--scale 1] [--json-out F] [--plot F]

One ``horovodrun`` job per workload runs every (codec, seed) pair in turn (calling the example's
``main``), so the launch cost is paid twice, not 48 times. ``--scale`` multiplies the steps
(GPT: steps per epoch; CNN: epochs). Prints a Markdown table per workload: mean ± sd over seeds,
the range, the difference to float32, and the wire bytes against a float32 ring.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = [
    ("none (fp32)", ["--compression", "none"]),
    ("fp16", ["--compression", "fp16"]),
    ("bf16", ["--compression", "bf16"]),
    ("int8 + EF", ["--compression", "int8"]),
    ("int8, no EF", ["--compression", "int8", "--no-error-feedback"]),
    ("topk 1% + EF", ["--compression", "topk", "--topk-ratio", "0.01"]),
    ("topk 1%, no EF", ["--compression", "topk", "--topk-ratio", "0.01", "--no-error-feedback"]),
    ("auto", ["--compression", "auto"]),  # only where hvdp.torch offers it (checked by the worker)
    # the peers (issue 16): torch DDP over Gloo with its hooks (its bf16 hook needs NCCL)
    ("DDP + fp16 hook", ["--ddp-hook", "fp16"]),
    ("DDP + PowerSGD r=4", ["--ddp-hook", "powersgd4"]),
    ("DDP + PowerSGD r=1", ["--ddp-hook", "powersgd1"]),
    # 4-bit (issue 22); appended so that the earlier rows keep their indexes (the run files' names)
    ("int4 + EF", ["--compression", "int4"]),
    ("int4, no EF", ["--compression", "int4", "--no-error-feedback"]),
]
# the study's sizes (the examples' defaults are larger): ~33 CPU-minutes for 3 seeds, measured (README)
WORKLOADS = {
    "cnn": {"script": "torch_cnn.py", "metric": "test_accuracy", "label": "test accuracy",
            "args": lambda scale: ["--epochs", str(8 * scale), "--batch-size", "32"]},
    "gpt": {"script": "torch_gpt.py", "metric": "val_loss", "label": "held-out loss (nats/byte)",
            "args": lambda scale: ["--d-model", "128", "--heads", "4", "--layers", "4", "--context", "128",
                                   "--batch-size", "8", "--accumulate", "2", "--epochs", "4",
                                   "--steps-per-epoch", str(20 * scale), "--warmup", str(10 * scale),
                                   "--val-windows", "64"]},
}


def worker(name, seeds, scale, out_dir, configs=None):
    """Inside horovodrun: every (codec, seed) run of one workload, one JSON file each."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import importlib
    import hvdp.torch as hvd
    wl = WORKLOADS[name]
    main = importlib.import_module(wl["script"][:-3]).main
    for i, (label, args) in enumerate(CONFIGS):
        if args[1] == "auto" and not hasattr(hvd.Compression, "auto"):
            continue
        if configs is not None and i not in configs:
            continue
        for s in seeds:
            out = os.path.join(out_dir, f"{name}-{i}-{s}.json")
            if not os.path.exists(out):
                main(wl["args"](scale) + args + ["--seed", str(s), "--quiet", "--json-out", out])


def launch(name, seeds, scale, out_dir, np_, configs=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    # Gloo: its waiting ranks block; MPI's poll, which on a shared, loaded machine starves the
    # rank that still computes (2 ranks sum identically over either)
    cmd = ["horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable, os.path.abspath(__file__),
           "--worker", name, "--scale", str(scale), "--out-dir", out_dir, "--seeds"] + [str(s) for s in seeds]
    if configs is not None:
        cmd += ["--configs"] + [str(i) for i in configs]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=7200, env=env)
    if r.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-3000:]}")
    return time.time() - t0


def summarise(name, seeds, out_dir):
    wl, rows = WORKLOADS[name], []
    for i, (label, _) in enumerate(CONFIGS):
        # seeds not run (a study cut short) are left out: the table says n
        runs = [f for f in (os.path.join(out_dir, f"{name}-{i}-{s}.json") for s in seeds) if os.path.exists(f)]
        if not runs:
            continue
        rs = [json.load(open(f)) for f in runs]
        vals = [r[wl["metric"]] for r in rs]
        run_seeds = [r["seed"] for r in rs]
        curve = [statistics.mean(c) for c in zip(*[r["train_curve"] for r in rs])]
        evals = [[e[0], statistics.mean(x[i][1] for x in [r["evals"] for r in rs])]
                 for i, e in enumerate(rs[0]["evals"])]
        rows.append({"config": label, "values": vals, "seeds": run_seeds, "mean": statistics.mean(vals),
                     "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0, "min": min(vals),
                     "max": max(vals), "wire_ratio": statistics.mean(r["wire_ratio"] for r in rs),
                     "codec": rs[0]["codec"], "steps": rs[0]["steps"], "global_batch": rs[0]["global_batch"],
                     "ranks_max_diff": max(r["ranks_max_diff"] for r in rs),
                     "seconds": statistics.mean(r["seconds"] for r in rs), "train_curve": curve, "evals": evals})
        if "test_loss" in rs[0]:
            rows[-1]["test_loss"] = statistics.mean(r["test_loss"] for r in rs)
    return rows


def table(name, rows, n_seeds):
    wl, base = WORKLOADS[name], dict(zip(rows[0]["seeds"], rows[0]["values"]))
    acc = name == "cnn"
    delta = "vs fp32, same seed (points)" if acc else "vs fp32, same seed (%)"
    extra = " test loss (mean) |" if acc else " bits per byte |"
    lines = [f"| compression | {wl['label']}: mean ± sd | range | {delta} |{extra} wire bytes ÷ fp32 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ds = [100 * (v - base[sd]) if acc else 100 * (v / base[sd] - 1)
              for sd, v in zip(r["seeds"], r["values"]) if sd in base]
        r["paired_delta"] = [statistics.mean(ds), statistics.stdev(ds) if len(ds) > 1 else 0.0]
        x = r["test_loss"] if acc else r["mean"] / math.log(2)
        n = "" if len(r["values"]) == n_seeds else f" (n={len(r['values'])})"
        lines.append(f"| {r['config']}{n} | {r['mean']:.4f} ± {r['stdev']:.4f} | {r['min']:.4f} – {r['max']:.4f} "
                     f"| {r['paired_delta'][0]:+.2f} ± {r['paired_delta'][1]:.2f} | {x:.4f} | {r['wire_ratio']:.3f} |")
    return "\n".join(lines)


def plot(results, path):
    """Top: training loss (mean of seeds, smoothed; GPT held-out loss as dots). Bottom: the same
    minus float32's, where codecs that overlap on top come apart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="col")
    titles = {"gpt": "byte-level GPT on stdlib sources", "cnn": "CNN on digits images"}
    for col, name in enumerate(("gpt", "cnn")):
        rows = results.get(name, [])
        if not rows:
            continue
        base = np.array(rows[0]["train_curve"])
        k = max(1, len(base) // 16)  # moving average over ~6% of the run

        def smooth(c):
            return np.arange(k, len(c) + 1), np.convolve(c, np.ones(k) / k, mode="valid")
        tab20 = plt.get_cmap("tab20").colors  # more rows than the default cycle's 10 colours:
        colors = tab20[::2] + tab20[1::2]     # its 10 dark shades first, then the light ones
        for j, r in enumerate(rows):
            c = np.array(r["train_curve"])
            style = "--" if r["config"].startswith("DDP") else "-"  # the peers dashed
            line, = axes[0, col].plot(*smooth(c), style, label=r["config"], lw=1.2, color=colors[j % 20])
            axes[1, col].plot(*smooth(c - base), style, color=line.get_color(), lw=1.2)
            if name == "gpt":
                e, e0 = np.array(r["evals"]), np.array(rows[0]["evals"])
                axes[0, col].plot(e[:, 0], e[:, 1], "o", color=line.get_color(), ms=3)
                axes[1, col].plot(e[:, 0], e[:, 1] - e0[:, 1], "o--", color=line.get_color(), ms=3, lw=0.8)
        axes[0, col].set_yscale("log")
        axes[0, col].set_title(f"{titles[name]}, 2 workers, mean of {len(rows[0]['values'])} seeds")
        axes[0, col].set_ylabel("training loss" + (" (dots: held-out)" if name == "gpt" else ""))
        axes[0, col].legend(fontsize=8)
        axes[1, col].axhline(0, color="grey", lw=0.6)
        axes[1, col].set_ylabel("minus float32's" + (" (dots: held-out)" if name == "gpt" else ""))
        axes[1, col].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--scale", type=int, default=1, help="multiply the steps (bigger study)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--workloads", nargs="+", default=["cnn", "gpt"], choices=sorted(WORKLOADS))
    p.add_argument("--out-dir", default=os.path.join(HERE, "results", "convergence_runs"),
                   help="one JSON per run; existing ones are kept (delete to rerun)")
    p.add_argument("--json-out", default=os.path.join(HERE, "results", "convergence.json"))
    p.add_argument("--plot", default=os.path.join(HERE, "results", "convergence.png"))
    p.add_argument("--no-run", action="store_true", help="only tabulate and plot the runs in --out-dir")
    p.add_argument("--configs", type=int, nargs="+", help="only these rows of CONFIGS (by index; 0, "
                   "float32, is every table's reference and always runs)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    configs = None if a.configs is None else sorted(set(a.configs) | {0})
    if a.worker:
        return worker(a.worker, a.seeds, a.scale, a.out_dir, configs)
    results, minutes = {}, {}
    for name in a.workloads:
        if not a.no_run:
            minutes[name] = launch(name, a.seeds, a.scale, a.out_dir, a.np, configs) / 60
            print(f"{name}: {minutes[name]:.1f} min", file=sys.stderr, flush=True)
        results[name] = summarise(name, a.seeds, a.out_dir)
    for name in a.workloads:
        r0 = results[name][0]
        took = f", {minutes[name]:.1f} min" if name in minutes else ""
        print(f"\n{name}: {a.np} workers, seeds {a.seeds}, {r0['steps']} steps of global batch "
              f"{r0['global_batch']}{took}; training seconds per run (mean of seeds): "
              + ", ".join(f"{r['config']} {r['seconds']:.0f}" for r in results[name]))
        print(table(name, results[name], len(a.seeds)))
    with open(a.json_out, "w") as f:
        json.dump({"seeds": a.seeds, "np": a.np, "scale": a.scale, "minutes": minutes, **results}, f, indent=1)
    plot(results, a.plot)


if __name__ == "__main__":
    main()
