"""``make bench``: every benchmark, side by side, into benchmarks/results/ (JSON, Markdown, PNG).

Ratios are measured within one run so that machine noise cancels; targets are printed next to
each figure, met or not. Not part of ``make test``.
"""
import json
import os
import platform
import subprocess
import sys
import time

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import join_cost  # noqa: E402  (the join control's per-step cost, Gloo and MPI)
import links  # noqa: E402  (the three-link stage)
import peers  # noqa: E402  (hvdp against DDP's hooks on the same links)
import outer_tta_report  # noqa: E402  (time to a target loss with outer steps)
import outer_warmup  # noqa: E402  (outer steps after a warm-up; against torchft's DiLoCo)
import tta_report  # noqa: E402  (time to a target loss, GPT, three links)
import two_level  # noqa: E402  (flat against two-level reduction on two nodes)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RES = os.path.join(HERE, "results")


def horovodrun(np_, args, timeout=900, controller="--mpi"):
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    cmd = ["horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", controller, sys.executable] + args
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-3000:]}")


def python(args, timeout=1800):
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    r = subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise SystemExit(f"failed: {args}\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stdout


def load(name):
    with open(os.path.join(RES, name)) as f:
        return json.load(f)


# step benchmarks over MPI (Horovod's faster controller here: ~1 ms per cycle against Gloo's
# ~6-8 ms); DDP brings its own Gloo process group either way
STAGES = [
    ("codec speed + wire bytes", lambda: python([os.path.join(HERE, "codecs_bench.py"), "--mib", "16",
                                                 "--json-out", os.path.join(RES, "codecs.json")])),
    ("step time np=1", lambda: horovodrun(1, [os.path.join(HERE, "step_bench.py"),
                                              "--json-out", os.path.join(RES, "step_np1.json")])),
    ("step time np=2 (+DDP)", lambda: horovodrun(2, [os.path.join(HERE, "step_bench.py"), "--ddp",
                                                     "--json-out", os.path.join(RES, "step_np2.json")])),
    ("join control per-step cost np=2 (Gloo, MPI)", lambda: python([os.path.join(HERE, "join_cost.py")])),
] + links.stages(python, RES) + [
    ("hvdp vs DDP's hooks (three links)", lambda: python([os.path.join(HERE, "peers.py")], timeout=5400)),
    ("time to target loss (GPT, three links)", lambda: python([os.path.join(HERE, "tta.py")], timeout=5400)),
    ("powersgd against DDP's PowerSGD hook (GPT, loopback, 3 seeds)",
     lambda: python([os.path.join(HERE, "powersgd_parity.py")], timeout=3600)),
    ("hvdp none and auto against Horovod's own optimizer and DDP plain (GPT, loopback, 3 seeds)",
     lambda: python([os.path.join(HERE, "runtime_gap.py")], timeout=3600)),
    ("Horovod's cycle time without a GPU: 1 ms against 5 ms (GPT, loopback, 2 jobs each)",
     lambda: python([os.path.join(HERE, "cycle_time.py")], timeout=3600)),
    ("time to target loss with outer steps (small GPT, three links, 3 seeds)",
     lambda: python([os.path.join(HERE, "outer_tta.py")], timeout=5400)),
    ("streaming outer steps: compute utilisation (loopback, 100 Mbit/s, 3 runs)",
     lambda: python([os.path.join(HERE, "outer_streaming.py")], timeout=3600)),
    ("outer steps after a synchronous warm-up (loopback 3 seeds; 100 and 10 Mbit/s)",
     lambda: python([os.path.join(HERE, "outer_warmup.py")], timeout=5400)),
    ("outer steps over a run four times as long (T = 1280, loopback, 3 seeds)",
     lambda: python([os.path.join(HERE, "outer_horizon.py")], timeout=3600)),
    ("the link through an int4 step: when each bucket starts, the release bound (100 Mbit/s)",
     lambda: python([os.path.join(HERE, "link_timeline.py")], timeout=1800)),
    ("outer steps on a second model (the CNN, inner SGD and AdamW; 3 seeds)",
     lambda: python([os.path.join(HERE, "outer_cnn.py")], timeout=1800)),
    ("outer steps on a third model (the digits MLP, inner SGD; 5 seeds)",
     lambda: python([os.path.join(HERE, "outer_cnn.py"), "--model", "digits", "--seeds", "0", "1", "2", "3", "4"],
                    timeout=1800)),
    ("outer steps against torchft's DiLoCo after the same warm-up (H = 16; loopback, 100 and 10 Mbit/s)",
     lambda: python([os.path.join(HERE, "outer_warmup.py"), "--peer", "torchft"], timeout=5400)),
    ("peak memory of a step (50M params)", lambda: python([os.path.join(HERE, "memory_bench.py"),
                                                            "--json-out", os.path.join(RES, "memory.json")])),
    ("two-level on two nodes (MPI and Gloo, 1 Gbit/s; MPI 100 Mbit/s)",
     lambda: python([os.path.join(HERE, "two_level.py")], timeout=3600)),
    ("cost model: checked on two nodes, projected to 8 GPUs x 2-128 nodes",
     lambda: python([os.path.join(HERE, "project_scale.py")], timeout=1800)),
    ("convergence (CNN + GPT, 3 seeds)", lambda: python([os.path.join(HERE, "convergence.py"),
                                                         "--json-out", os.path.join(RES, "convergence.json")],
                                                        timeout=3600)),
]


def fmt(m_ci):
    m, ci = m_ci
    return f"{m:.3f} ± {ci:.3f}"


def report(elapsed):
    rows = []
    s1, s2 = load("step_np1.json"), load("step_np2.json")
    rows.append(("hvdp (none) ÷ raw Horovod step time, np=1", fmt(s1["ratio_hvdp_over_horovod"]),
                 "≤ 1.02", s1["ratio_hvdp_over_horovod"][0] <= 1.02))
    rows.append(("hvdp (none) ÷ raw Horovod step time, np=2", fmt(s2["ratio_hvdp_over_horovod"]),
                 "≤ 1.02", s2["ratio_hvdp_over_horovod"][0] <= 1.02))
    if "ratio_hvdp_over_ddp" in s2:
        rows.append(("hvdp (none) ÷ torch DDP (gloo) step time, np=2", fmt(s2["ratio_hvdp_over_ddp"]),
                     "≤ 1.0", s2["ratio_hvdp_over_ddp"][0] <= 1.0))
    scal = s2["samples_per_s"]["hvdp"][0] / (2 * s1["samples_per_s"]["hvdp"][0])
    rows.append(("scaling: samples/s np=2 ÷ (2 × np=1), hvdp", f"{scal:.3f}", "≥ 0.9", scal >= 0.9))
    cb = load("codecs.json")
    for k in ["fp16", "bf16", "int8", "int8+EF", "int8 compiled", "int8+EF compiled"]:
        g, ci, ratio = cb["speed"][k]
        rows.append((f"codec {k}: compress+decompress GB/s ÷ memcpy", f"{ratio:.3f}",
                     "≥ 0.5" if k.startswith("int8") and "EF" not in k else "—",
                     ratio >= 0.5 if k.startswith("int8") and "EF" not in k else None))
    targets = {"int8 encode+decode": 0.6, "int8+EF encode (residual)+decode": 0.35, "bf16 encode+decode": 0.6}
    for k, row in cb.get("kernels", {}).items():  # issue 11: fused CPU kernels vs array ops
        for col in ("kernel (torch)", "kernel (numpy)", "array ops (torch)"):
            if col in row:
                t = targets.get(k) if col == "kernel (torch)" else None
                rows.append((f"codec {k}, {col}: GB/s ÷ memcpy (median of paired ratios; best)",
                             f"{row[col][2]:.3f}; {row[col][4]:.3f}" if len(row[col]) > 4 else f"{row[col][2]:.3f}",
                             f"≥ {t}" if t else "—", row[col][2] >= t if t else None))
    for p in (2, 4, 8):
        measured, formula = cb["wire"][f"int8@{p}"]
        rows.append((f"wire bytes int8 ÷ fp32, P={p} (formula {formula:.4f})", f"{measured:.4f}",
                     "≤ 0.27", measured <= 0.27))
    for k in ("fp16", "bf16"):
        rows.append((f"wire bytes {k} ÷ fp32, P=2", f"{cb['wire'][f'{k}@2'][0]:.4f}", "—", None))
    for controller in ("gloo", "mpi"):
        try:
            res = load(os.path.basename(join_cost.path(controller)))
        except FileNotFoundError:
            continue
        rows += [(m, v, "—", None) for m, v in join_cost.rows(res)]
    rows += links.rows(load)
    rows += peers.target_rows()
    rows += tta_report.target_rows()
    try:
        rows += outer_tta_report.target_rows(load("outer_tta.json"))
    except FileNotFoundError:
        rows.append(("time to target with outer steps", "not run", "—", None))
    try:
        rows += outer_warmup.torchft_rows(load("outer_warmup_torchft.json"))
    except FileNotFoundError:
        rows.append(("outer steps against torchft's DiLoCo after the same warm-up", "not run", "—", None))
    for controller, rate in two_level.RUNS:
        try:
            res = load(os.path.basename(two_level.path(controller, rate)))
        except FileNotFoundError:
            continue
        rows += two_level.rows(res, f"two nodes, {controller}, {rate}: ")
    sl = load(os.path.basename(links.path(RES, "1gbit")))
    for k, m in load("memory.json").items():
        sm = m["summary"]
        rows.append((f"peak extra memory of a step, {k}, {m['grad_mb']:.0f} MB gradient (MB; ÷ gradient)",
                     f"{sm['extra_mb']:.0f} ({sm['ratio']:.2f}x)", f"≤ {sm['target_mb']:.0f} (2x + residuals)",
                     sm["extra_mb"] <= sm["target_mb"]))
    conv = load("convergence.json")
    for wl, what in (("cnn", "CNN digits test accuracy"), ("gpt", "GPT held-out loss")):
        base = conv[wl][0]["mean"]
        for c in conv[wl]:
            ef8 = c["config"] == "int8 + EF"
            d = 100 * (c["mean"] - base) if wl == "cnn" else 100 * (c["mean"] / base - 1)
            rows.append((f"{what}, {c['config']} (n={len(c['values'])} seeds)",
                         f"{c['mean']:.4f} ± {c['stdev']:.4f} ({d:+.2f} {'pts' if wl == 'cnn' else '%'})",
                         ("within 0.5 pts of fp32" if wl == "cnn" else "within 1% of fp32") if ef8 else "—",
                         abs(d) <= (0.5 if wl == "cnn" else 1.0) if ef8 else None))
    mark = {True: "met", False: "NOT met", None: ""}
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()}, "
             f"Python {platform.python_version()}; `make bench` took {elapsed / 60:.1f} min.", "",
             "| measurement | value (mean ± 95% CI) | target | |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {mark[d]} |" for a, b, c, d in rows]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(RES, "results.md"), "w") as f:
        f.write(md)
    plot(s1, s2, sl, cb)
    return md


def plot(s1, s2, sl, cb):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    names = ["fp16", "bf16", "int8"]
    ax.bar(names, [cb["wire"][f"{n}@2"][0] for n in names], color="#4c72b0")
    ax.axhline(0.27, color="red", ls="--", label="int8 target 0.27")
    ax.set_ylabel("wire bytes ÷ float32 ring (P=2)")
    ax.set_title("Bytes on the wire")
    ax.legend()
    ax = axes[1]
    if "skipped" not in sl:
        keys = list(sl["step_s"])
        ax.bar(keys, [sl["step_s"][k][0] * 1e3 for k in keys], yerr=[sl["step_s"][k][1] * 1e3 for k in keys],
               color="#55a868")
        ax.set_ylabel("step time, ms (2 workers)")
        ax.set_title(f"Slow link: {sl['rate']} loopback, {sl['grad_mb']:.0f} MB of gradients")
    else:
        ax.text(0.5, 0.5, "slow link skipped:\n" + sl["skipped"], ha="center")
    fig.tight_layout()
    fig.savefig(os.path.join(RES, "bench.png"), dpi=110)


def main():
    os.makedirs(RES, exist_ok=True)
    t0 = time.time()
    bar = tqdm(STAGES, desc="bench", ncols=90)
    for label, fn in bar:
        bar.set_postfix_str(label)
        fn()
    md = report(time.time() - t0)
    print("\n" + md)


if __name__ == "__main__":
    main()
