"""Streaming outer steps at their limit (issue 35, item 2): does a fragment's exchange hide under
the inner steps? A stage beside ``outer_tta.py`` (the same GPT, data, horizon and worker), with
only what this question needs, so it runs on an otherwise idle machine in minutes:

    python benchmarks/outer_streaming.py [--repeats N]
    # -> results/outer_streaming.json, outer_streaming.md

Per link (the unthrottled loopback and 100 Mbit/s), taking turns step by step in the same
processes: compute only (no communication), hvdp outer H 8 and 16 with int4 (one fragment, no
delay: the whole exchange at the sync step), and streaming (K fragments, tau = 1 or 2, int4) with
the second phase started from the gradient hooks (``HVDP_OVERLAP`` on, the default) and at
landing (``HVDP_OVERLAP=0``). Compute utilisation: the compute-only median step ÷ a method's mean
step (the steps after the first 16), issue 35's target ≥ 0.9 for streaming at 100 Mbit/s; beside
it, for reading the noise, compute-only's mean step ÷ the method's (slow steps of the shared
machine count on both sides; compute only's own mean ÷ its median shows their share). Each
link's job runs ``--repeats`` times (default 3): the table gives the median of the repeats and
their range.
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
import slowlink  # noqa: E402

RES = os.path.join(HERE, "results")
LINKS = [("none", "loopback, unthrottled"), ("100mbit", "100 Mbit/s")]
STREAMING = [(16, 4, 1), (16, 4, 2), (8, 2, 1)]  # (H, K, tau), int4


def methods(sz, rate):
    """(label, kind, spec) of outer_tta's worker, for this stage."""
    out = [(f"hvdp outer H{H} int4", "outer", {"H": H, "codec": "int4"}) for H in (8, 16) if H in sz["H"]]
    for H, K, tau in STREAMING:
        if H not in sz["H"]:
            continue
        for overlap in (True, False):
            out.append((f"hvdp streaming H{H} K{K} tau{tau} int4" + ("" if overlap else " (HVDP_OVERLAP=0)"),
                        "outer", {"H": H, "codec": "int4", "K": K, "tau": tau, "overlap": overlap}))
    return out + [("compute only", "compute", None)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--quick", action="store_true", help="outer_tta's quick size (T = 32): for trying")
    a = ap.parse_args()
    stem = os.path.join(RES, "outer_streaming_quick" if a.quick else "outer_streaming")
    if a.report_only:
        with open(stem + ".json") as f:
            results = json.load(f)
    else:
        t0, results = time.time(), {"links": {}}
        size = "quick" if a.quick else "full"
        for rate, _ in LINKS:
            why = slowlink.unavailable(rate, isolate=True)
            if why:
                results["links"][rate] = {"skipped": why}
                continue
            runs = []
            for rep in range(a.repeats):
                with slowlink.link(rate, isolate=True) as (prefix, gbit):
                    res = slowlink.run_job(prefix, "outer_tta.py", ["--worker", "--size", size, "--rate", rate,
                                                                    "--methods", "outer_streaming"], timeout=1800)
                s = outer_tta.summarise(res, target=float("-inf"))
                runs.append({"measured_gbit_s": gbit, "compute_s": s["compute_s"],
                             "compute_mean_s": s["compute_mean_s"],
                             "ranks_identical_at_T": res["ranks_identical_at_T"],
                             "methods": {k: {f: r[f] for f in ("step_median", "step_mean", "utilisation",
                                                               "utilisation_of_means", "mb_per_step", "final_loss")}
                                         for k, r in s["methods"].items()}})
                print(f"{rate} repeat {rep}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            results["links"][rate] = runs
        results["minutes"] = (time.time() - t0) / 60
        results["horovod_cycle"] = slowlink.horovod_cycle()
        results["bucket"] = slowlink.BUCKET
        results["load"] = os.getloadavg()[0]
        with open(stem + ".json", "w") as f:
            json.dump(results, f)
    md = report(results)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)


def report(results):
    def mid(xs, fmt):
        return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"

    lines = [f"Streaming outer steps (int4), small GPT of outer_tta.py, 2 workers, T = 320; median of "
             f"{max(len(r) for r in results['links'].values() if isinstance(r, list))} runs per link (range). "
             f"The run took {results.get('minutes', float('nan')):.1f} min; load average "
             f"{results.get('load') or os.getloadavg()[0]:.1f} at its end. Horovod's cycle: "
             f"{slowlink.cycle_words(results)}. Throttled link: {slowlink.bucket_words(results)}.", ""]
    targets = []
    for rate, label in LINKS:
        runs = results["links"].get(rate)
        if not isinstance(runs, list):
            lines.append(f"- {label}: skipped ({(runs or {}).get('skipped', 'not run')})")
            continue
        lines += ["", f"**{label}** (measured {mid([r['measured_gbit_s'] or float('nan') for r in runs], '{:.4f}')} "
                  f"Gbit/s): compute only {mid([r['compute_s'] for r in runs], '{:.4f}')} s/step (mean "
                  f"{mid([r['compute_mean_s'] for r in runs], '{:.4f}')}); ranks identical "
                  "at T after the last sync: " + ", ".join(f"{sum(r['ranks_identical_at_T'].values())} of "
                                                           f"{len(r['ranks_identical_at_T'])}" for r in runs), "",
                  "| method | step (s, median) | step (s, mean) | compute utilisation | compute only's mean ÷ mean "
                  "| MB/step/worker | held-out loss at T |",
                  "|---|---|---|---|---|---|---|"]
        for k in runs[0]["methods"]:
            col = {f: [r["methods"][k][f] for r in runs] for f in runs[0]["methods"][k]}
            lines.append(f"| {k} | {mid(col['step_median'], '{:.4f}')} | {mid(col['step_mean'], '{:.4f}')} | "
                         f"{mid(col['utilisation'], '{:.3f}')} | {mid(col['utilisation_of_means'], '{:.3f}')} | "
                         f"{mid(col['mb_per_step'], '{:.3f}')} | "
                         f"{mid(col['final_loss'], '{:.4f}')} |")
            if rate == "100mbit" and "streaming" in k and "OVERLAP=0" not in k:
                u = statistics.median(col["utilisation"])
                targets.append(f"| {label}: compute utilisation of {k} | {u:.4f} | ≥ {outer_tta.UTILISATION} | "
                               f"{'met' if u >= outer_tta.UTILISATION else 'NOT met'} |")
    lines += ["", "| target | value (median) | wanted | |", "|---|---|---|---|"] + targets
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
