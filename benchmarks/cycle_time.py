"""Horovod's background cycle on a machine without a GPU: the step at Horovod's default (1 ms) and
at the 5 ms that ``hvd.init()`` sets for such a job (``hvdp.cluster.cycle``).

    python benchmarks/cycle_time.py [--repeats 2]   # results/cycle_time.{json,md}

One ``benchmarks/tta.py`` worker job per cycle time and repeat (seed 0, the unthrottled loopback;
the runtime_gap.py methods: hvdp none, hvdp auto, Horovod's own optimizer, DDP plain, and
"compute only", taking turns step by step in the same two processes), the cycle times alternating
job by job (1, 5, 1, 5, ...) so the machine's drift hits both alike; ``HOROVOD_CYCLE_TIME`` is
set for each job, so hvd.init() keeps it. Every method runs in processes where Horovod's thread
cycles, DDP and "compute only" included: what the cycle costs them is CPU taken by that thread.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import slowlink  # noqa: E402
import tta  # noqa: E402
from powersgd_parity import run_seed, spread  # noqa: E402  (one tta.py worker job)
from runtime_gap import METHODS  # noqa: E402

CYCLES = ("1", "5")  # Horovod's default; hvdp's for a job without a GPU


def step_of(res, label):
    s = res["summary"]
    return s["compute_s"] if label == "compute only" else s["methods"][label]["step_s"]


def report(jobs, minutes, load):
    labels = ("compute only",) + METHODS
    lines = [f"Horovod's cycle time at 1 ms (Horovod's default) and 5 ms (what hvd.init() sets without a GPU), "
             f"the tta.py GPT on the unthrottled loopback, 2 workers, horovodrun --gloo, seed 0, "
             f"{len(jobs) // len(CYCLES)} job(s) per cycle time, alternating; the run took {minutes:.1f} min, "
             f"load average {load:.1f} at its end. Step: median of the steady steps (s).", "",
             "| job | cycle (ms) | " + " | ".join(f"{k} step" for k in labels) + " | "
             + " | ".join(f"{k} to target (s)" for k in METHODS) + " |",
             "|---" * (2 + len(labels) + len(METHODS)) + "|"]
    for i, res in enumerate(jobs):
        m = res["summary"]["methods"]
        lines.append(f"| {i} | {res['cycle_ms']} | " + " | ".join(f"{step_of(res, k):.3f}" for k in labels) + " | "
                     + " | ".join("not reached" if m[k]["seconds_to_target"] is None
                                  else f"{m[k]['seconds_to_target']:.1f}" for k in METHODS) + " |")
    lines += ["", "| method | step 5 ms / 1 ms (median, min, max over job pairs) | "
              "step / DDP plain's at 1 ms | at 5 ms |", "|---|---|---|---|"]
    pairs = list(zip(jobs[0::2], jobs[1::2]))
    for k in labels:
        ratio = [step_of(b, k) / step_of(a, k) for a, b in pairs]
        over = [[step_of(r, k) / step_of(r, "ddp") for r in jobs if r["cycle_ms"] == c] for c in CYCLES]
        lines.append(f"| {k} | {spread(ratio)} | {spread(over[0])} | {spread(over[1])} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    stem = os.path.join(tta.RES, "cycle_time")

    def run():
        jobs = []
        for _ in range(a.repeats):
            for c in CYCLES:
                os.environ["HOROVOD_CYCLE_TIME"] = c  # the workers inherit it; hvd.init() keeps it
                res = run_seed(0, "none", methods=METHODS)
                res["cycle_ms"] = c
                jobs.append(res)
        os.environ.pop("HOROVOD_CYCLE_TIME")
        return {"jobs": jobs}
    saved = slowlink.saved_or_run(stem, a.report_only, run, cycle=False)  # each job names its own
    md = report(saved["jobs"], saved["minutes"], saved["load"])
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
