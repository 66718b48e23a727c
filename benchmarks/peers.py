"""hvdp against DDP's communication hooks on the three links of ``benchmarks/links.py``: step time
÷ DDP plain and bytes on the wire per step, for the same model in the same two processes.

    python benchmarks/peers.py [--report-only]     # results/peers_<rate>.json, peers.md, peers.png

Each link runs ``peers_bench.py`` under ``horovodrun --gloo -np 2`` inside its own network
namespace (also the unthrottled one, so that the namespace's loopback counters count this job's
traffic alone). Needs root; without it the stage says so and writes nothing else.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import links  # noqa: E402
import slowlink  # noqa: E402

RES = os.path.join(HERE, "results")


def path(rate):
    return os.path.join(RES, f"peers_{rate}.json")


def run(rate):
    why = slowlink.unavailable(rate, isolate=True)
    if why:
        res = {"skipped": why}
    else:
        with slowlink.link(rate, isolate=True) as (prefix, gbit):
            res = slowlink.run_job(prefix, "peers_bench.py", [], timeout=1800)
        res.update(rate=rate, measured_gbit_s=gbit, grad_mb=4 * res["params"] / 1e6)
    with open(path(rate), "w") as f:
        json.dump(res, f, indent=1)
    return res


def load_all():
    out = {}
    for rate, label in links.LINKS:
        try:
            with open(path(rate)) as f:
                out[rate] = (label, json.load(f))
        except FileNotFoundError:
            pass
    return out


def rows(results):
    """(link, method, step ÷ DDP, wire MB/step by the loopback, by hvdp's count) per method."""
    out = []
    for rate, (label, res) in results.items():
        if "skipped" in res:
            out.append((label, "skipped: " + res["skipped"], None, None, None))
            continue
        gbit = res.get("measured_gbit_s") or float("nan")
        where = f"{label} ({gbit:.2f} Gbit/s measured)"
        for k, (m, ci) in res["ratio_over_ddp"].items():
            lo = res["lo_bytes_per_step_per_worker"][k][0] / 1e6
            own = res["hvdp_sent_per_step_per_worker"].get(k)
            out.append((where, k, (m, ci), lo, own / 1e6 if own is not None else None))
        for k, why in res.get("refused", {}).items():
            out.append((where, k, None, None, f"refused by DDP: {why}"))
    return out


def target_rows(results=None):
    """run_all's (measurement, value, target, met) rows: issue 16's two targets, per link."""
    results = load_all() if results is None else results
    out = []
    for rate, (label, res) in results.items():
        if "skipped" in res:
            out.append((f"hvdp vs DDP's hooks, {label}", "skipped: " + res["skipped"], "—", None))
            continue
        r = {k: v[0] for k, v in res["ratio_over_ddp"].items()}
        ddps = {k: v for k, v in r.items() if k.startswith("ddp")}
        if rate == "1gbit" and "ddp+powersgd4" in r and "hvdp int8" in r:
            out.append((f"{label}: hvdp int8 ÷ DDP plain vs DDP + PowerSGD rank 4", f"{r['hvdp int8']:.3f} "
                        f"vs {r['ddp+powersgd4']:.3f}", "≤ PowerSGD 4's", r["hvdp int8"] <= r["ddp+powersgd4"]))
        if "hvdp auto" in r:
            best = min(ddps, key=ddps.get)
            out.append((f"{label}: hvdp auto ÷ DDP plain vs the fastest DDP variant ({best})",
                        f"{r['hvdp auto']:.3f} vs {ddps[best]:.3f}", "≤ every DDP variant",
                        r["hvdp auto"] <= ddps[best]))
    return out


def table(results):
    lines = ["| link | method | step ÷ DDP plain (mean ± 95% CI) | MB/step/worker on the loopback | "
             "MB/step/worker, hvdp's count |", "|---|---|---|---|---|"]
    for where, k, r, lo, own in rows(results):
        if r is None:
            lines.append(f"| {where} | {k} | — | — | {own or ''} |")
            continue
        own_s = f"{own:.2f}" if isinstance(own, float) else "—"
        lines.append(f"| {where} | {k} | {r[0]:.3f} ± {r[1]:.3f} | {lo:.2f} | {own_s} |")
    return "\n".join(lines)


def plot(results, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = {r: v for r, v in results.items() if "skipped" not in v[1]}
    if not done:
        return
    methods = list(next(iter(done.values()))[1]["ratio_over_ddp"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [done[r][1]["ratio_over_ddp"].get(m, [float("nan"), 0]) for r in done]
        ax.bar([j + i * width for j in range(len(done))], [y[0] for y in ys], width, yerr=[y[1] for y in ys],
               label=m, color=("C0" if m.startswith("ddp") else "C1"), alpha=0.35 + 0.65 * (i + 1) / len(methods))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(done))], [done[r][0] for r in done])
    ax.set_ylabel("step time ÷ DDP plain")
    ax.set_title("hvdp (orange) against DDP's hooks (blue), 2 workers, same model and batch")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    if not a.report_only:
        for rate, _ in links.LINKS:
            run(rate)
    results = load_all()
    text = table(results)
    with open(os.path.join(RES, "peers.md"), "w") as f:
        f.write(text + "\n")
    plot(results, os.path.join(RES, "peers.png"))
    print(text)


if __name__ == "__main__":
    main()
