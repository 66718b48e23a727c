"""The report of ``outer_tta.py`` (time to a target loss with outer steps): its table, the
targets of issue 35 and the plot, from the JSON that ``outer_tta.py`` writes
(``python benchmarks/outer_tta.py --report-only`` redraws them)."""
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from outer_tta import (DEFAULT, FINAL_LOSS, LINKS, LOOPBACK_OVER_NONE, OVER_DDP, OVER_TORCHFT,  # noqa: E402
                       UTILISATION)


def best(rows, kinds):
    got = {k: r["seconds_to_target"] for k, r in rows.items() if r["kind"] in kinds and r["seconds_to_target"]}
    return min(got.items(), key=lambda kv: kv[1]) if got else (None, None)


def target_rows(results):
    """(measurement, value, wanted, met) for outer_tta.md."""
    out = []
    links = results["links"]
    for rate, label in LINKS:
        res = links.get(rate)
        if res is None or "skipped" in res:
            out.append((f"{label}", "skipped: " + (res or {}).get("skipped", "not run"), "—", None))
            continue
        rows = res["summary"]["methods"]
        if rate == "none":
            d, n = rows.get(DEFAULT, {}), rows.get("fp32 DP (hvdp none)", {})
            if d.get("seconds_to_target") and n.get("seconds_to_target"):
                r = d["seconds_to_target"] / n["seconds_to_target"]
                out.append((f"{label}: time to target, {DEFAULT} ÷ hvdp none",
                            f"{d['seconds_to_target']:.1f} s ÷ {n['seconds_to_target']:.1f} s = {r:.3f}",
                            f"≤ {LOOPBACK_OVER_NONE}", r <= LOOPBACK_OVER_NONE))
            else:
                out.append((f"{label}: time to target, {DEFAULT} ÷ hvdp none",
                            f"{DEFAULT}: {'not reached' if not d.get('seconds_to_target') else 'reached'}; "
                            f"hvdp none: {'not reached' if not n.get('seconds_to_target') else 'reached'}",
                            f"≤ {LOOPBACK_OVER_NONE}", False))
            continue
        hk, ht = best(rows, ("outer", "hvdp"))
        dk, dt = best(rows, ("ddp", "postlocal"))
        what = f"{label}: time to target, hvdp's best ÷ the best DDP method (post-local SGD included)"
        if dk is None:
            finals = ", ".join(f"{k} {r['final_loss']:.4f}" for k, r in rows.items()
                               if r["kind"] in ("ddp", "postlocal"))
            slowest = max((r["train_s"] for r in rows.values() if r["kind"] in ("ddp", "postlocal")), default=None)
            out.append((what, f"no DDP method reached the target in T steps (final losses: {finals}); hvdp's best "
                        f"{hk} {ht or float('nan'):.1f} s; the DDP runs took up to {slowest:.1f} s",
                        f"≤ {OVER_DDP[rate]}", None))
        elif hk is None:
            out.append((what, f"no hvdp method reached it; DDP's best {dk} {dt:.1f} s", f"≤ {OVER_DDP[rate]}", False))
        else:
            out.append((what, f"{hk} {ht:.1f} s ÷ {dk} {dt:.1f} s = {ht / dt:.3f}", f"≤ {OVER_DDP[rate]}",
                        ht / dt <= OVER_DDP[rate]))
        for H in res["size"]["H"]:
            ours = {k: r for k, r in rows.items() if r["kind"] == "outer" and k.startswith(f"hvdp outer H{H} ")}
            ok, ot = best(ours, ("outer",))
            theirs = rows.get(f"torchft DiLoCo H{H}")
            what = f"{label}: H={H}, hvdp's best outer ÷ torchft DiLoCo"
            if theirs is None:
                why = res.get("refused", {}).get(f"torchft DiLoCo H{H}", "not run")
                out.append((what, f"torchft did not run: {why}", f"≤ {OVER_TORCHFT[rate]}", None))
            elif not theirs["seconds_to_target"] or not ot:
                t = theirs["seconds_to_target"]
                said = f"{t:.1f} s" if t else f"not reached (final {theirs['final_loss']:.4f})"
                ours_said = f"{ok} {ot:.1f} s" if ot else "no hvdp outer run reached it"
                finals = ", ".join(f"{k} {r['final_loss']:.4f}" for k, r in ours.items())
                out.append((what, f"{ours_said} (final losses: {finals}); torchft {said}",
                            f"≤ {OVER_TORCHFT[rate]}", bool(ot) and not t))
            else:
                r = ot / theirs["seconds_to_target"]
                out.append((what, f"{ok} {ot:.1f} s ÷ {theirs['seconds_to_target']:.1f} s = {r:.3f}",
                            f"≤ {OVER_TORCHFT[rate]}", r <= OVER_TORCHFT[rate]))
        if rate == "100mbit":
            for k, r in rows.items():
                if "streaming" in k and "utilisation" in r:
                    out.append((f"{label}: compute utilisation of {k} (compute-only step ÷ its mean step)",
                                f"{r['utilisation']:.3f}", f"≥ {UTILISATION}", r["utilisation"] >= UTILISATION))
    finals = results.get("final_losses", {})
    if finals.get(DEFAULT) and finals.get("fp32 DP (hvdp none)"):
        d, n = finals[DEFAULT], finals["fp32 DP (hvdp none)"]
        md, mn = statistics.mean(d), statistics.mean(n)
        out.append((f"held-out loss at T, {DEFAULT} ÷ fp32 DP − 1 (mean of {len(d)} seeds; per seed: "
                    + ", ".join(f"{x:.4f} vs {y:.4f}" for x, y in zip(d, n)) + ")",
                    f"{md:.4f} ÷ {mn:.4f} − 1 = {md / mn - 1:+.4f}", f"≤ {FINAL_LOSS}", md / mn - 1 <= FINAL_LOSS))
    return out


def table(results):
    lines = ["| method | link | steps to target | seconds to target | held-out loss at T | step time (s, median) "
             "| compute utilisation | MB/step/worker (mean) |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for rate, label in LINKS:
        res = results["links"].get(rate)
        if res is None or "skipped" in res:
            continue
        s = res["summary"]
        notes.append(f"- {label} (measured {res.get('measured_gbit_s') or float('nan'):.4f} Gbit/s): compute only "
                     f"{s['compute_s']:.4f} s/step; job {res['job_s'] / 60:.1f} min; ranks identical at T after "
                     f"the last sync: {sum(res['ranks_identical_at_T'].values())} of "
                     f"{len(res['ranks_identical_at_T'])} outer runs; hvdp none's losses equal the loopback's: "
                     f"{res.get('fp32_deterministic')}")
        for k, r in s["methods"].items():
            to = f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] is not None else "not reached"
            lines.append(f"| {k} | {label} | {r['reached_step'] or '—'} | {to} | {r['final_loss']:.4f} | "
                         f"{r['step_median']:.4f} | {r.get('utilisation', float('nan')):.2f} | "
                         f"{r['mb_per_step']:.3f} |")
        for k, why in res.get("refused", {}).items():
            lines.append(f"| {k} | {label} | — | could not run: {why} | — | — | — | — |")
    return "\n".join(lines), notes


def plot(results, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [(label, results["links"][r]) for r, label in LINKS
            if r in results["links"] and "skipped" not in results["links"][r]]
    if not done:
        return
    fig, axes = plt.subplots(1, len(done), figsize=(6.5 * len(done), 5), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    style = {"outer": "-", "hvdp": "-.", "ddp": "--", "postlocal": ":", "torchft": (0, (3, 1, 1, 1))}
    for ax, (label, res) in zip(axes[0], done):
        for j, (k, r) in enumerate(res["summary"]["methods"].items()):
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, linestyle=style.get(r["kind"], "-"), color=colors[j % 20], label=k, lw=1.2)
        ax.axhline(results["target"], color="k", lw=0.8, ls=":", label="target")
        ax.set_title(label)
        ax.set_xscale("log")
        ax.set_xlabel("training seconds (log; evaluations not counted)")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_ylim(results["target"] * 0.97, results["target"] * 1.3)
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle("small GPT, 2 workers: held-out loss against wall-clock (outer solid, per-step hvdp dash-dot, "
                 "DDP dashed, post-local dotted)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
