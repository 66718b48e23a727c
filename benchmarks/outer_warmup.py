"""Outer steps after synchronous warm-up steps (issue 35): how much of the held-out loss that
outer steps lose at outer_tta.py's horizon does a warm-up of W synchronous steps win back? A stage
beside ``outer_tta.py`` (the same GPT, data, horizon T = 320 and worker): the losses on the
unthrottled loopback (they do not depend on the link), then the time to target at 100 and
10 Mbit/s, with the warm-up in float32 and through int4 (``warmup_compression``).

    python benchmarks/outer_warmup.py [--seeds N] [--links 100mbit,10mbit] [--report-only]
    # -> results/outer_warmup.json, outer_warmup.md
    python benchmarks/outer_warmup.py --peer torchft   # torchft's DiLoCo after the same warm-up
    # -> results/outer_warmup_torchft.json, outer_warmup_torchft.md (torchft_methods)

Per seed (initial weights and batches), taking turns step by step in the same processes: fp32 DP
(hvdp none), hvdp's default outer configuration (H = 8, int8, outer Nesterov SGD lr 0.7,
momentum 0.9) and parameter averaging (H = 8, int8, outer lr 1, no momentum) after W synchronous
warm-up steps (``warmup_steps=W``: the gradients averaged in float32 before each inner step), and
DDP's post-local SGD (``start_localSGD_iter=W``) beside them. W is a multiple of 16, so that every
evaluation (every 16 steps) sees the ranks' common parameters. Target: each seed's fp32 DP loss at
T x 1.01, as in outer_tta.py. Step times on this link are those of the loopback (noise ±10-25%
between runs on two cores); the question here is the loss.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import outer_tta  # noqa: E402
from outer_tta_report import best  # noqa: E402
import slowlink  # noqa: E402

RES = os.path.join(HERE, "results")
WARMUPS = (0, 32, 96, 160)
TIMED_W = 96  # the warm-up of the throttled link's outer runs (the loss study's best-but-one, 30% of T)


def methods(sz, rate):
    """(label, kind, spec) of outer_tta's worker, for this stage: on the loopback the loss study,
    on a throttled link the time to target beside the per-step methods and DDP's. At 10 Mbit/s
    the float32 per-step methods (fp32 DP, DDP plain: twice DDP + fp16's bytes, so never the best
    DDP method there) and the float32 warm-up's H = 8 outer runs are left out, as in outer_tta.py:
    each would take minutes per seed on that link."""
    if rate != "none":
        slow = rate == "10mbit"
        outer = ((16, "int8"),) if slow else ((8, "int8"), (8, "int4"), (16, "int8"))
        per_step = [("fp32 DP (hvdp none)", "hvdp", "none"), ("hvdp int4", "hvdp", "int4"), ("ddp", "ddp", "none"),
                    ("ddp+fp16", "ddp", "fp16"), ("ddp+powersgd8", "ddp", "powersgd8")]
        per_step = [m for m in per_step if not (slow and m[2] == "none")]
        return per_step \
            + [(f"hvdp outer H{H} {c} W{TIMED_W}", "outer", {"H": H, "codec": c, "W": TIMED_W}) for H, c in outer] \
            + [(f"hvdp outer H16 int8 W{TIMED_W} (warm-up int4)", "outer",
                {"H": 16, "codec": "int8", "W": TIMED_W, "warm": "int4"}),
               (f"ddp post-local SGD H8 W{TIMED_W}", "postlocal", {"H": 8, "W": TIMED_W}),
               ("compute only", "compute", None)]
    out = [("fp32 DP (hvdp none)", "hvdp", "none")]
    for W in WARMUPS:
        out.append((f"hvdp outer H8 int8 W{W}", "outer", {"H": 8, "codec": "int8", "W": W}))
    for W in WARMUPS[:3]:
        out.append((f"hvdp averaging H8 int8 W{W}", "outer",
                    {"H": 8, "codec": "int8", "W": W, "lr": 1.0, "momentum": 0.0}))
    for W in (0, 32):
        out.append((f"ddp post-local SGD H8 W{W}", "postlocal", {"H": 8, "W": W}))
    return out


def torchft_methods(sz, rate):
    """``--peer torchft``: torchft's DiLoCo at H = 16 after the same W synchronous float32 warm-up
    steps (outer_tta.TorchftRun) beside hvdp's outer runs at H = 16 (pseudo-gradients in float32,
    as torchft's, and int8; the warm-up in float32 and through int4); fp32 DP on the loopback for
    the target. At 10 Mbit/s hvdp's float32 pseudo-gradients are left out (each run takes minutes
    per seed there; the loopback and 100 Mbit/s show its training against torchft's)."""
    hv = [(f"hvdp outer H16 {c} W{TIMED_W}", "outer", {"H": 16, "codec": c, "W": TIMED_W})
          for c in (("int8",) if rate == "10mbit" else ("none", "int8"))]
    hv.append((f"hvdp outer H16 int8 W{TIMED_W} (warm-up int4)", "outer",
               {"H": 16, "codec": "int8", "W": TIMED_W, "warm": "int4"}))
    tft = [(f"torchft DiLoCo H16 W{TIMED_W}", "torchft", {"H": 16, "W": TIMED_W})]
    if rate == "none":
        return [("fp32 DP (hvdp none)", "hvdp", "none")] + hv + tft
    return hv + tft + [("compute only", "compute", None)]


TORCHFT_WANTED = {"100mbit": 1.0, "10mbit": 0.7}  # issue 35: hvdp's time ÷ torchft's at the same H


def torchft_rows(results):
    """(measurement, value, wanted, met) of ``--peer torchft``: per link, each seed's best hvdp
    outer run's time to target ÷ torchft's DiLoCo's (H = 16, the same warm-up), median (range)."""
    rows = []
    for rate, wanted in TORCHFT_WANTED.items():
        runs = per_seed((results.get("links") or {}).get(rate))
        what = f"{rate}, H = 16, W = {TIMED_W}: hvdp's best time to target ÷ torchft DiLoCo's"
        ratios, names = [], []
        for r in runs:
            name, mine = best(r["methods"], ("outer",))
            _, theirs = best(r["methods"], ("torchft",))
            if mine and theirs:
                ratios.append(mine / theirs)
                names.append(name)
        if not runs or len(ratios) < len(runs):
            rows.append((what, f"not shown ({len(ratios)} of {len(runs)} seeds where both reached the target)",
                         f"≤ {wanted}", None if not runs else False))
            continue
        med = statistics.median(ratios)
        rows.append((what, f"{med:.3f} ({min(ratios):.3f}–{max(ratios):.3f}; {', '.join(sorted(set(names)))})",
                     f"≤ {wanted}", med <= wanted))
    return rows


def run_seeds(seeds, methods="outer_warmup"):
    """The loss study on the loopback: one job per seed (``methods``: outer_tta's --methods)."""
    out, t0 = [], time.time()
    for seed in range(seeds):
        with slowlink.link("none", isolate=True) as (prefix, _):
            res = slowlink.run_job(prefix, "outer_tta.py", ["--worker", "--size", "full", "--rate", "none",
                                                            "--seed", str(seed), "--methods", methods],
                                   timeout=1800)
        target = res["methods"]["fp32 DP (hvdp none)"]["evals"][-1][1] * 1.01
        s = outer_tta.summarise(res, target)
        out.append({"seed": seed, "target": target, "ranks_identical_at_T": res["ranks_identical_at_T"],
                    "methods": {k: {f: r[f] for f in ("reached_step", "seconds_to_target", "final_loss",
                                                      "step_median", "mb_per_step")}
                                for k, r in s["methods"].items()}})
        print(f"seed {seed}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def run_links(rates, seeds, n, kept=None, burst=None, methods="outer_warmup"):
    """The time to each seed's target on each throttled link, seeds 0..n-1 (``kept``: runs of an
    earlier call, by link, whose seeds are not run again; ``burst``: slowlink.link's)."""
    out = {}
    for rate in rates:
        why = slowlink.unavailable(rate, isolate=True)
        if why:
            out[rate] = {"skipped": why}
            continue
        runs = [r for r in per_seed((kept or {}).get(rate)) if r["seed"] < n]
        for seed in sorted(set(range(n)) - {r["seed"] for r in runs}):
            t0 = time.time()
            with slowlink.link(rate, isolate=True, burst=burst) as (prefix, gbit):
                res = slowlink.run_job(prefix, "outer_tta.py", ["--worker", "--size", "full", "--rate", rate,
                                                                "--seed", str(seed), "--methods", methods],
                                       timeout=2400)
            s = outer_tta.summarise(res, seeds[seed]["target"])
            runs.append({"seed": seed, "measured_gbit_s": gbit, "compute_s": s["compute_s"], "methods": s["methods"],
                         "minutes": (time.time() - t0) / 60})
            print(f"{rate} seed {seed}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        out[rate] = sorted(runs, key=lambda r: r["seed"])
    return out


def per_seed(got):
    """A link's runs as a list (the first run of this stage saved seed 0's alone, as a dict)."""
    if not got or "skipped" in got:
        return []
    return got if isinstance(got, list) else [dict(got, seed=0)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--links", default="100mbit,10mbit", help="throttled links for the time to target ('': none)")
    ap.add_argument("--link-seeds", type=int, default=3, help="seeds on each throttled link (default 3)")
    ap.add_argument("--links-only", action="store_true",
                    help="keep the JSON's loss study and the link runs it has; run the missing seeds")
    ap.add_argument("--bucket", type=int, help="the links' token bucket in bytes at every rate, unchecked "
                    "(262144: the one of before 2026-12-06, which banks idle time), with outer_warmup.json's loss "
                    "study; writes outer_warmup_bucketN.json/.md")
    ap.add_argument("--peer", choices=("torchft",), help="torchft: its DiLoCo at H = 16 after the same warm-up, "
                    "beside hvdp's H = 16 runs (torchft_methods), its own loss study and links; writes "
                    "outer_warmup_torchft.json/.md")
    a = ap.parse_args()
    if a.peer and (a.bucket or a.links_only):
        raise SystemExit("outer_warmup: --peer runs its own loss study and links; drop --bucket / --links-only")
    stem = os.path.join(RES, "outer_warmup" + (f"_bucket{a.bucket}" if a.bucket else "")
                        + (f"_{a.peer}" if a.peer else ""))
    chosen = "outer_warmup:torchft_methods" if a.peer else "outer_warmup"
    why = None if a.report_only else slowlink.unavailable("none", isolate=True)
    if not why and a.peer:
        import torchft_diloco
        why = torchft_diloco.ensure_installed()
    if why:
        raise SystemExit(f"outer_warmup: {why}")

    def run():
        old = {}
        if a.links_only or a.bucket:
            with open(stem + ".json" if a.links_only else os.path.join(RES, "outer_warmup.json")) as f:
                old = json.load(f)
            seeds, study = old["seeds"], old.get("study_minutes", old["minutes"])
        else:
            t0 = time.time()
            seeds = run_seeds(a.seeds, chosen)
            study = (time.time() - t0) / 60
        links = run_links([r for r in a.links.split(",") if r], seeds, min(a.link_seeds, len(seeds)),
                          old.get("links") if a.links_only else None, a.bucket, chosen)
        out = {"seeds": seeds, "study_minutes": study, "links": links}
        if a.bucket:
            out["bucket"] = f"token bucket {a.bucket} bytes at every rate, unchecked (--bucket)"
        return out

    results = slowlink.saved_or_run(stem, a.report_only, run)
    md = report(results, *((("torchft",), "torchft DiLoCo") if a.peer else ()))
    if a.peer:
        mark = {True: "met", False: "NOT met", None: ""}
        md += "\n".join(["", "| target | value | wanted | |", "|---|---|---|---|"]
                        + [f"| {m} | {v} | {w} | {mark[k]} |" for m, v, w, k in torchft_rows(results)]) + "\n"
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)


def report(results, ref=("ddp", "postlocal"), ref_word="DDP"):
    """outer_warmup.md; each link's times against the best of the methods of kinds ``ref``
    (``ref_word`` in the table: DDP's methods with post-local SGD, or torchft's DiLoCo)."""
    seeds = results["seeds"]
    fp32 = statistics.mean(s["methods"]["fp32 DP (hvdp none)"]["final_loss"] for s in seeds)
    same = [sum(s["ranks_identical_at_T"].values()) for s in seeds]
    link_min = sum(r.get("minutes", 0) for g in results["links"].values() for r in per_seed(g))
    lines = [f"Outer steps after W synchronous warm-up steps: outer_tta.py's GPT, 2 workers, T = 320, unthrottled "
             f"loopback, {len(seeds)} seeds. The loss study took {results.get('study_minutes', float('nan')):.1f} "
             f"min, the links {link_min:.1f} ({slowlink.bucket_words(results)}); load average "
             f"{results['load']:.1f} at its end. Ranks identical at T "
             "after the last sync: "
             + ", ".join(f"{n} of {len(s['ranks_identical_at_T'])}" for n, s in zip(same, seeds))
             + f" (per seed). fp32 DP's held-out loss at T, mean of the seeds: {fp32:.4f}.", "",
             "| method | held-out loss at T (per seed) | mean / fp32 DP's mean | steps to target (per seed) "
             "| seconds to target ÷ fp32 DP's (same seed): median (range) | MB/step/worker (seed 0) |",
             "|---|---|---|---|---|---|"]
    for k in seeds[0]["methods"]:
        losses = [s["methods"][k]["final_loss"] for s in seeds]
        steps = [s["methods"][k]["reached_step"] for s in seeds]
        secs = [(s["methods"][k]["seconds_to_target"], s["methods"]["fp32 DP (hvdp none)"]["seconds_to_target"])
                for s in seeds]
        ratios = [a / b for a, b in secs if a and b]
        ratio = (f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
                 if len(ratios) == len(secs) else "—")
        lines.append(f"| {k} | {', '.join(f'{x:.4f}' for x in losses)} | {statistics.mean(losses) / fp32:.3f} | "
                     f"{', '.join('—' if x is None else str(x) for x in steps)} | {ratio} | "
                     f"{seeds[0]['methods'][k]['mb_per_step']:.3f} |")
    for rate, got in (results.get("links") or {}).items():
        runs = per_seed(got)
        if not runs:
            lines += ["", f"{rate}: skipped ({(got or {}).get('skipped', 'not run')})"]
            continue
        bests = [best(r["methods"], ref) for r in runs]
        gbit = ", ".join(f"{r['measured_gbit_s']:.4f}" for r in runs)
        compute = ", ".join(f"{r['compute_s']:.4f}" for r in runs)
        named = ", ".join(f"{k} {v:.1f} s" if k else "none reached the target" for k, v in bests)
        lines += ["", f"**{rate}** (measured {gbit} Gbit/s), seeds {', '.join(str(r['seed']) for r in runs)}, each "
                  f"against its own fp32 DP loss x 1.01 from the loopback; compute only {compute} s/step; best "
                  f"{ref_word} method{' (post-local SGD included)' if 'postlocal' in ref else ''} per seed: "
                  f"{named}", "",
                  f"| method | steps to target | seconds to target | / best {ref_word}: median (range) | floor / best "
                  f"{ref_word} | held-out loss at T | step (s, median) | MB/step/worker |",
                  "|---|---|---|---|---|---|---|---|"]

        def spread(xs):
            return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})" if len(xs) == len(runs) else "—"
        for k in runs[0]["methods"]:
            rs = [r["methods"][k] for r in runs]
            secs = [r["seconds_to_target"] for r in rs]
            ratio = spread([sec / b for sec, (_, b) in zip(secs, bests) if sec and b])
            # the floor: its steps to target at the compute-only step (an exchange that costs nothing)
            floor = spread([m["reached_step"] * r["compute_s"] / b for m, r, (_, b) in zip(rs, runs, bests)
                            if m["reached_step"] and b])
            steps = ", ".join(str(r["reached_step"] or "—") for r in rs)
            seconds = ", ".join(f"{x:.1f}" if x else "not reached" for x in secs)
            finals = ", ".join(f"{r['final_loss']:.4f}" for r in rs)
            lines.append(f"| {k} | {steps} | {seconds} | {ratio} | {floor} | {finals} | "
                         f"{statistics.median(r['step_median'] for r in rs):.4f} | "
                         f"{statistics.median(r['mb_per_step'] for r in rs):.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
