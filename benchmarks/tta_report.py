"""The report of ``tta.py`` (time to a target loss, GPT, three links): its table, the step beside
its limit (``breakdown.py``), the targets of issues 36 and earlier, and the plot, from the JSON
that ``tta.py`` writes (``python benchmarks/tta.py --report-only`` redraws them)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import breakdown  # noqa: E402
from tta import AUTO_OVER_DDP, HVDP_OVER_DDP, LINKS, RATIO_RANGE, RES  # noqa: E402


def best(rows, kind):
    got = {k: r["seconds_to_target"] for k, r in rows.items() if r["kind"] == kind and r["seconds_to_target"]}
    return min(got.items(), key=lambda kv: kv[1]) if got else (None, None)


def target_rows(results=None):
    """(measurement, value, target, met) rows, for tta.md and run_all's results.md."""
    if results is None:
        try:
            with open(os.path.join(RES, "tta.json")) as f:
                results = json.load(f)["links"]
        except FileNotFoundError:
            return [("time to target loss", "not run", "—", None)]
    out = []
    for rate, label, _ in LINKS:
        res = results.get(rate)
        if res is None or "skipped" in res:
            out.append((f"time to target, {label}", "skipped: " + (res or {}).get("skipped", "not run"), "—", None))
            continue
        s = res["summary"]
        rows = s["methods"]
        lo, hi = RATIO_RANGE
        for k, v in s["exchange_over_compute"].items():
            out.append((f"{label}: fp32 gradient {k} ÷ compute only, per step", f"{v:.2f}",
                        f"{lo:g}–{hi:g}" if rate != "none" else "—", lo <= v <= hi if rate != "none" else None))
        for k, v in s["visible_over_compute"].items():
            out.append((f"{label}: ({k}'s step − compute) ÷ compute (exchange not hidden by the backward)",
                        f"{v:.2f}", "—", None))
        if rate == "none":
            a, d = rows.get("hvdp auto", {}), rows.get("ddp", {})
            if a.get("seconds_to_target") and d.get("seconds_to_target"):
                r = a["seconds_to_target"] / d["seconds_to_target"]
                out.append((f"{label}: time to target, hvdp auto ÷ DDP plain",
                            f"{a['seconds_to_target']:.1f} s ÷ {d['seconds_to_target']:.1f} s = {r:.3f}",
                            f"≤ {AUTO_OVER_DDP}", r <= AUTO_OVER_DDP))
            else:
                out.append((f"{label}: time to target, hvdp auto ÷ DDP plain",
                            "auto or DDP plain did not reach the target", f"≤ {AUTO_OVER_DDP}", False))
            continue
        hk, ht = best(rows, "hvdp")
        dk, dt = best(rows, "ddp")
        what = f"{label}: time to target, hvdp's best ÷ the best DDP method"
        if dk is None:
            finals = ", ".join(f"{k} {r['final_loss']:.4f}" for k, r in rows.items() if r["kind"] == "ddp")
            out.append((what, f"no DDP method reached it (final losses: {finals}); hvdp's best: "
                        f"{hk or 'none'} {ht or float('nan'):.1f} s", f"≤ {HVDP_OVER_DDP}", None))
        elif hk is None:
            out.append((what, f"no hvdp method reached it; DDP's best {dk} {dt:.1f} s", f"≤ {HVDP_OVER_DDP}", False))
        else:
            out.append((what, f"{hk} {ht:.1f} s ÷ {dk} {dt:.1f} s = {ht / dt:.3f}", f"≤ {HVDP_OVER_DDP}",
                        ht / dt <= HVDP_OVER_DDP))
    return out


def ran(results):
    """(label, what it stands for, result) of each link that ran, in LINKS' order."""
    return [(label, stands, results[rate]) for rate, label, stands in LINKS
            if rate in results and "skipped" not in results[rate]]


def table(results):
    k0 = next((r["size"]["steady_from"] for r in results.values() if "size" in r), 0)
    lines = [f"| method | link | steps to target | seconds to target | step time (s, median of steps > {k0}) | "
             f"MB/step/worker (mean of steps > {k0}) |",
             "|---|---|---|---|---|---|"]
    notes = []
    for label, stands, res in ran(results):
        s = res["summary"]
        ratio = ", ".join(f"{k} {s['exchange_s'][k]:.3f} s = {v:.2f}x" for k, v in s["exchange_over_compute"].items())
        evals = [r["eval_s"] for r in s["methods"].values() if r["eval_s"]]
        notes.append(f"- {label} (measured {res.get('measured_gbit_s') or float('nan'):.3f} Gbit/s; stands for "
                     f"{stands}): compute only {s['compute_s']:.3f} s/step; fp32 {ratio}; "
                     f"held-out evaluation {sum(evals) / len(evals):.3f} s each, every "
                     f"{res['size']['eval_every']} steps (not counted); hvdp none deterministic against the "
                     f"target run: {s['fp32_deterministic']}")
        for k, r in s["methods"].items():
            to = (f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] is not None
                  else f"not reached (final loss {r['final_loss']:.4f} at step {r['steps']})")
            lines.append(f"| {k} | {label} | {r['reached_step'] or '—'} | {to} | {r['step_s']:.3f} | "
                         f"{r['mb_per_step']:.2f} |")
        for k, why in res.get("refused", {}).items():
            lines.append(f"| {k} | {label} | — | refused by DDP: {why} | — | — |")
    return "\n".join(lines + ["", "Step time against its limit (`benchmarks/breakdown.py`):", "", breakdown.HEADER]
                     + breakdown_rows(results)), notes


def breakdown_rows(results):
    """Each training method's step beside its limit, with hvdp's phases (issue 36, item 1)."""
    out = []
    for label, _, res in ran(results):
        s = res["summary"]
        for k, r in s["methods"].items():
            phases = res["methods"][k].get("phase_ms")
            out.append(breakdown.row(k, label, r["step_s"], s["compute_s"], r["mb_per_step"] * 1e6,
                                     res.get("measured_gbit_s"), phases))
    return out


def plot(results, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [(label, res) for label, _, res in ran(results)]
    if not done:
        return
    fig, axes = plt.subplots(1, len(done), figsize=(6 * len(done), 4.5), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for ax, (label, res) in zip(axes[0], done):
        for j, (k, r) in enumerate(res["summary"]["methods"].items()):
            xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
            ax.plot(xs, ys, "--" if r["kind"] == "ddp" else "-", color=colors[(2 * j) % 20 + (j >= 10)],
                    label=k, lw=1.2, marker=".", ms=3)
        ax.axhline(res["target"], color="k", lw=0.8, ls=":", label="target")
        ax.set_title(label)
        ax.set_xlabel("training seconds (evaluations not counted)")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_ylim(res["target"] * 0.97, res["target"] * 1.25)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("GPT, 2 workers: held-out loss against wall-clock (hvdp solid, DDP dashed)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
