"""Final test accuracy on digits by compression, same seeds and steps, 2 workers (horovodrun).

    python benchmarks/convergence.py [--seeds 0 1 2] [--epochs 15] [--np 2]

Prints one row per configuration: mean and spread over the seeds, and the difference to fp32.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [
    ("none (fp32)", ["--compression", "none"]),
    ("fp16", ["--compression", "fp16"]),
    ("bf16", ["--compression", "bf16"]),
    ("int8 + EF", ["--compression", "int8"]),
    ("int8, no EF", ["--compression", "int8", "--no-error-feedback"]),
    ("topk 1% + EF", ["--compression", "topk", "--topk-ratio", "0.01"]),
    ("topk 1%, no EF", ["--compression", "topk", "--topk-ratio", "0.01", "--no-error-feedback"]),
]


def run(args, seed, epochs, np_):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = ["horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", sys.executable,
               os.path.join(ROOT, "examples", "torch_digits.py"), "--quiet", "--seed", str(seed),
               "--epochs", str(epochs), "--json-out", out] + args
        env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if r.returncode != 0:
            raise SystemExit(f"run failed: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-2000:]}")
        with open(out) as f:
            return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--json-out")
    a = p.parse_args()
    rows = []
    for label, args in CONFIGS:
        accs, ratios = [], []
        for s in a.seeds:
            r = run(args, s, a.epochs, a.np)
            accs.append(r["test_accuracy"])
            ratios.append(r["wire_ratio"])
            print(f"  {label:<15} seed {s}: test accuracy {r['test_accuracy']:.4f}", file=sys.stderr, flush=True)
        rows.append({"config": label, "accs": accs, "mean": statistics.mean(accs),
                     "stdev": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                     "wire_ratio": statistics.mean(ratios)})
    base = rows[0]["mean"]
    print(f"\ndigits, {a.np} workers, {a.epochs} epochs, seeds {a.seeds}")
    print(f"| {'compression':<15} | test accuracy (mean ± sd) | vs fp32 (points) | wire bytes / fp32 |")
    print(f"|{'-' * 17}|{'-' * 26}|{'-' * 18}|{'-' * 19}|")
    for r in rows:
        print(f"| {r['config']:<15} | {r['mean']:.4f} ± {r['stdev']:.4f}          | "
              f"{100 * (r['mean'] - base):+16.2f} | {r['wire_ratio']:17.3f} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
