"""hvdp's powersgd against DDP's PowerSGD hook over seeds (issue 36, item 4): steps to the target
and step time at ranks 1, 4 and 8, the same warm-up, in the time-to-accuracy run's setting.

    python benchmarks/powersgd_parity.py [--seeds 0 1 2] [--rate none]   # results/powersgd_parity.{json,md}
    python benchmarks/powersgd_parity.py --q-seeds 0 1 2 3 4 --ranks 1     # results/powersgd_parity_q.{json,md}

``--q-seeds``: the weights and batches of the first ``--seeds`` seed in every job, only both
PowerSGDs' initial Q drawn from each Q seed in turn: how far the initial Q alone moves each one's
result (the spread a difference between the two must stand out from).

Per seed, one ``benchmarks/tta.py`` worker job (``--seed S --only ...``): the GPT's weights, the
batches and both PowerSGDs' initial Q come from the seed; the target is that seed's float32 loss
at step T x 1.01 (its own target run); the six runs (hvdp powersgd r, DDP + PowerSGD r, r in 1, 4,
8) take turns step by step in the same two processes, as in tta.py. Wanted (issue 36): steps to
the target within 10% of DDP's at each rank, step time within 5% (medians over the seeds). A run
that does not reach the target within 2T steps is compared by its final held-out loss instead.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import slowlink  # noqa: E402
import tta  # noqa: E402

RANKS = (1, 4, 8)
STEPS_WITHIN, TIME_WITHIN = 0.10, 0.05


def labels(ranks=RANKS):
    return [f"hvdp powersgd{r}" for r in ranks] + [f"ddp+powersgd{r}" for r in ranks]


def run_seed(seed, rate, controller="gloo", methods=None, q_seed=None):
    """One tta.py worker job of ``methods`` (labels; default this stage's) with ``seed``'s weights,
    batches and target on link ``rate`` (PowerSGD's initial Q from ``q_seed`` where given, else
    from ``seed``): its JSON with ``summary`` (tta.summarise)."""
    isolate = slowlink.unavailable(rate, isolate=True) is None
    why = slowlink.unavailable(rate, isolate=isolate)
    if why:
        raise SystemExit(f"the link {rate} cannot be made here: {why}")
    args = ["--worker", "--size", "full", "--seed", str(seed), "--only", ";".join(methods or labels())]
    args += [] if q_seed is None else ["--q-seed", str(q_seed)]
    t0 = time.time()
    with slowlink.link(rate, isolate=isolate) as (prefix, gbit):
        res = slowlink.run_job(prefix, "tta.py", args, timeout=3600, controller=controller)
    res.update(rate=rate, measured_gbit_s=gbit, job_s=time.time() - t0, seed=seed, q_seed=q_seed)
    res["summary"] = tta.summarise(res)
    print(f"seed {seed}: {res['job_s']:.0f} s", file=sys.stderr, flush=True)
    return res


def compare(per_seed, ranks=RANKS):
    """Per rank: hvdp's and DDP's steps to target, final loss and step time per seed (per Q seed
    where the jobs differ only in it); the ratios hvdp / DDP, their medians, met or not."""
    rows = []
    for r in ranks:
        h, d = f"hvdp powersgd{r}", f"ddp+powersgd{r}"
        seeds = []
        for res in per_seed:
            m = res["summary"]["methods"]
            seed = res["seed"] if res.get("q_seed") is None else f"Q {res['q_seed']}"
            seeds.append({"seed": seed, "hvdp_steps": m[h]["reached_step"], "ddp_steps": m[d]["reached_step"],
                          "hvdp_final": m[h]["final_loss"], "ddp_final": m[d]["final_loss"],
                          "hvdp_step_s": m[h]["step_s"], "ddp_step_s": m[d]["step_s"]})
        both = [s for s in seeds if s["hvdp_steps"] and s["ddp_steps"]]
        steps = [s["hvdp_steps"] / s["ddp_steps"] for s in both]
        times = [s["hvdp_step_s"] / s["ddp_step_s"] for s in seeds]
        finals = [s["hvdp_final"] / s["ddp_final"] for s in seeds]
        rows.append({"rank": r, "seeds": seeds, "steps_ratio": steps, "time_ratio": times, "final_ratio": finals,
                     "reached": {"hvdp": sum(bool(s["hvdp_steps"]) for s in seeds),
                                 "ddp": sum(bool(s["ddp_steps"]) for s in seeds)}})
    return rows


def spread(xs):
    return f"{statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})" if xs else "—"


def report(per_seed, rows, minutes, rate, controller="gloo", load=None, cycle=None):
    load = os.getloadavg()[0] if load is None else load
    targets = ", ".join(f"{r['target']:.4f}" for r in per_seed)
    lines = [f"hvdp powersgd against DDP + PowerSGD, same rank, warm-up of {per_seed[0]['size']['powersgd_start']} "
             f"plain steps, link {rate}, Horovod over {controller} (horovodrun --{controller}), "
             + (f"seeds {[r['seed'] for r in per_seed]}" if per_seed[0].get("q_seed") is None else
                f"seed {per_seed[0]['seed']} (weights, batches), PowerSGD's initial Q from the Q seeds "
                f"{[r['q_seed'] for r in per_seed]}") + f"; the run took {minutes:.1f} min, "
             f"load average {load:.1f} at its end. Target per seed: its float32 loss at step "
             f"T = {per_seed[0]['size']['T']} x 1.01 ({targets}). Horovod's cycle: "
             f"{cycle or slowlink.horovod_cycle()}.", "",
             "| rank | seed | hvdp steps to target | DDP steps | hvdp final loss | DDP final loss | hvdp step (s) "
             "| DDP step (s) |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for s in row["seeds"]:
            lines.append(f"| {row['rank']} | {s['seed']} | {s['hvdp_steps'] or 'not reached'} | "
                         f"{s['ddp_steps'] or 'not reached'} | {s['hvdp_final']:.4f} | {s['ddp_final']:.4f} | "
                         f"{s['hvdp_step_s']:.3f} | {s['ddp_step_s']:.3f} |")
    lines += ["", "| rank | steps to target, hvdp / DDP (seeds where both reached it) | wanted | | "
              "step time, hvdp / DDP | wanted | | final loss, hvdp / DDP |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        st, tm = row["steps_ratio"], row["time_ratio"]
        ok_s = None if not st else all(abs(x - 1) <= STEPS_WITHIN for x in st)
        ok_t = statistics.median(tm) <= 1 + TIME_WITHIN
        reach = f" (reached: hvdp {row['reached']['hvdp']}, DDP {row['reached']['ddp']} of {len(row['seeds'])})"
        lines.append(f"| {row['rank']} | {spread(st)}{reach} | within {STEPS_WITHIN:.0%} every seed | "
                     f"{'' if ok_s is None else ('met' if ok_s else 'NOT met')} | {spread(tm)} | "
                     f"<= {1 + TIME_WITHIN:.2f} (median) | {'met' if ok_t else 'NOT met'} | "
                     f"{spread(row['final_ratio'])} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rate", default="none", help="tc rate of the link (none: loopback, unthrottled)")
    ap.add_argument("--controller", default="gloo", choices=("gloo", "mpi"),
                    help="Horovod's controller (horovodrun --gloo or --mpi); DDP runs over Gloo either way")
    ap.add_argument("--q-seeds", type=int, nargs="+", default=None,
                    help="one job per Q seed, all with the first --seeds seed's weights and batches")
    ap.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    stem = os.path.join(tta.RES, "powersgd_parity" + ("" if a.controller == "gloo" else f"_{a.controller}")
                        + ("" if a.q_seeds is None else "_q"))
    if a.report_only:
        with open(stem + ".json") as f:
            saved = json.load(f)
        per_seed, minutes = saved["runs"], saved["minutes"]
        a.controller, load, cycle = saved.get("controller", "gloo"), saved.get("load"), slowlink.cycle_words(saved)
    else:
        t0 = time.time()
        if a.q_seeds is None:
            per_seed = [run_seed(s, a.rate, a.controller, labels(a.ranks)) for s in a.seeds]
        else:
            per_seed = [run_seed(a.seeds[0], a.rate, a.controller, labels(a.ranks), q) for q in a.q_seeds]
        minutes, load, cycle = (time.time() - t0) / 60, os.getloadavg()[0], slowlink.horovod_cycle()
        with open(stem + ".json", "w") as f:
            json.dump({"minutes": minutes, "rate": a.rate, "controller": a.controller, "load": load,
                       "horovod_cycle": cycle, "ranks": a.ranks, "runs": per_seed}, f)
    ranks = saved.get("ranks", RANKS) if a.report_only else a.ranks
    md = report(per_seed, compare(per_seed, ranks), minutes, a.rate, a.controller, load, cycle)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
