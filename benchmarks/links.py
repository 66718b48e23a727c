"""The three-link stage of ``make bench``: step time ÷ none for none, fp16, bf16, int8 and auto
on a 1 Gbit/s and a 3 Gbit/s token-bucket loopback (network namespace + tc, root) and on the
unthrottled loopback; auto's choice per bucket and its probe's cost on each. Rows for
``results.md`` come from the JSON files the stage writes (``results/links_<rate>.json``)."""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
LINKS = [("1gbit", "1 Gbit/s"), ("3gbit", "3 Gbit/s"), ("none", "loopback, unthrottled")]
CODECS = "none,fp16,bf16,int8,auto"
INT8_TARGET_1GBIT = 0.35     # the wire alone is 0.254 of float32 at P=2
AUTO_SLACK = 1.05            # auto within 5% of the best fixed codec, never above 1.05 x none


def path(res_dir, rate):
    return os.path.join(res_dir, f"links_{rate}.json")


def stages(python, res_dir):
    """(label, callable) per link, for run_all's STAGES."""
    return [(f"step ÷ none, {label}", lambda rate=rate: python([
        os.path.join(HERE, "slowlink.py"), "--rate", rate, "--codecs", CODECS,
        "--json-out", path(res_dir, rate)])) for rate, label in LINKS]


def _auto_rows(where, res):
    auto = next(iter(res.get("auto", {}).values()), None)
    if auto is None:
        return []
    chosen = "; ".join(f"{b['bucket']} ({b['elements']:,} el.): {b['codec'].split('(')[0]}"
                       for b in auto["buckets"])
    step = res["step_s"]["auto"][0]
    share = auto["probe_wall_s"] / (1000 * step)
    t = auto.get("trial")
    trial = (", ".join(f"{k} {v:.0f}" for k, v in t["ms"].items()) + f" ms/step: kept {t['kept']}"
             if t else "no trial (the probe's proposal was none)")
    return [(f"{where}: auto's choice per bucket", chosen, "—", None),
            (f"{where}: auto's trial ({t['steps'] if t else 0} steps each)", trial, "—", None),
            (f"{where}: auto's probe (ms; ÷ a 1,000-step run at auto's step time)",
             f"{1e3 * auto['probe_wall_s']:.0f} ms ({100 * share:.2f}%)", "< 2%", share < 0.02)]


def rows(load):
    """(measurement, value, target, met) rows of every link measured."""
    out = []
    for rate, label in LINKS:
        try:
            res = load(os.path.basename(path("", rate)))
        except FileNotFoundError:
            out.append((f"step ÷ none, {label}", "not run", "—", None))
            continue
        if "skipped" in res:
            out.append((f"step ÷ none, {label}", "skipped: " + res["skipped"], "—", None))
            continue
        gbit = res.get("measured_gbit_s") or float("nan")
        where = f"{label} (measured {gbit:.2f} Gbit/s, {res['grad_mb']:.0f} MB grads)"
        r = res["ratio_over_none"]
        fixed = {k: v[0] for k, v in r.items() if k != "auto"}
        for k, (m, ci) in r.items():
            if k == "none":
                continue
            target, met = "—", None
            if k == "int8" and rate == "1gbit":
                target, met = f"≤ {INT8_TARGET_1GBIT}", m <= INT8_TARGET_1GBIT
            if k == "auto":
                best = min(fixed, key=fixed.get)
                bound = AUTO_SLACK * min(fixed[best], 1.0)
                target, met = f"≤ {bound:.3f} (1.05 × best fixed: {best})", m <= bound
            out.append((f"{where}: {k} ÷ none step time", f"{m:.3f} ± {ci:.3f}", target, met))
        out += _auto_rows(where, res)
    return out


def main():
    """Run the three links (unless ``--report-only``) and write ``results/links.md``."""
    import argparse
    import json
    import platform
    import subprocess
    import sys
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    res_dir = os.path.join(HERE, "results")

    def python(args):
        subprocess.run([sys.executable] + args, check=True, timeout=1800)

    def load(name):
        with open(os.path.join(res_dir, name)) as f:
            return json.load(f)
    if not a.report_only:
        for _, run in stages(python, res_dir):
            run()
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} cores; load average when written: "
             f"{load_avg:.1f}", "", "| measurement | value (mean ± 95% CI) | target | |", "|---|---|---|---|"]
    mark = {True: "met", False: "NOT met", None: ""}
    lines += [f"| {m} | {v} | {t} | {mark[k]} |" for m, v, t, k in rows(load)]
    with open(os.path.join(res_dir, "links.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
