"""Time to a target loss: wall-clock seconds until the GPT's held-out loss first reaches the
target, for hvdp's codecs and torch DDP's hooks, on the unthrottled loopback and two throttled
links (issue 22).

    python benchmarks/tta.py [--quick] [--report-only]   # results/tta.json, tta.md, tta.png

The model is the convergence study's byte-level GPT (``examples/torch_gpt.py``: d=128, 4 layers,
context 128, 0.88M parameters, 3.5 MB of float32 gradients, bf16 autocast), 2 workers with
micro-batch 16 each (global batch 32, the study's), AdamW, clipping at 1.0, warm-up, then cosine
decay to 0.1 of the peak at step T = 80, that floor after it. Each link runs this file under
``horovodrun --gloo -np 2`` inside its own network namespace (``slowlink.link``; the unthrottled
one too, so that the namespace's loopback counter counts this job's bytes alone); DDP runs over
its own Gloo group in the same two processes.

- Target: float32's (hvdp none's) held-out loss at step T x 1.01. The loopback's job first trains
  hvdp none alone for T steps to find it; every link's job then stops each method at its first
  evaluation at or under it. A method not there by 2T steps is "not reached", with its final
  loss. hvdp none is deterministic: its evaluations on each link are checked against the
  target run's (``fp32_deterministic`` in the report).
- Methods: hvdp none, bf16, int8 (+ error feedback, its default), each of ("int4", "powersgd")
  that ``hvdp.codecs.names()`` lists when it runs (powersgd at ranks 1, 4 and 8 when it takes
  ``rank``, with DDP's warm-up of ``powersgd_start`` plain steps), int8 and int4 in 512 KiB
  buckets (7 instead of 1: their exchange overlaps the backward pass), auto; DDP plain, + fp16 hook,
  + bf16 hook (DDP refuses it on Gloo: its message is kept), + PowerSGD ranks 1, 4, 8 (error
  feedback, warm start, plain allreduce for its first ``powersgd_start`` steps, one DDP bucket).
  Horovod's own ``horovod.torch.DistributedOptimizer`` ("horovod none") only when ``--only``
  names it (``runtime_gap.py``). Each is its own run from the same initial weights with the
  same batches (one per step and rank); the runs take turns step by step in the same processes,
  so that the machine's noise hits all alike.
- Timed: the training steps only (a barrier before each; the slower rank's time). The held-out
  evaluations (every ``eval_every`` steps, 64 windows) are not counted; their cost is reported.
- Bytes per step: the namespace loopback's transmit counter around each step, / 2 workers.
- Exchange : compute, medians: "compute only" (the same step without any communication) takes
  its turn for T steps too, "exchange only" (the GPT's float32 gradients as one buffer, through
  Horovod's allreduce and through DDP's Gloo group, no compute) for 12. Also reported: the
  exchange a step shows, step time minus compute only (less: both overlap it with the backward).

The throttled rates are chosen for that ratio, 2-5x, as for a GPU cluster on Ethernet: the
float32 exchange alone was measured at 0.28 s per step at 200 Mbit/s and 0.47 s at 120 Mbit/s
(the bytes: 3.5 MB per worker, both workers' through the one shaped loopback), so 0.35 s at 160
Mbit/s and 0.56 s at 100 Mbit/s, against ~0.13 s of compute per step on an idle core: about 2.7x
and 4.3x. A step here computes about 1000x slower than on an H100, so at the same ratio a rate R
here stands for about 1000 R per GPU there (``LINKS``).

Budget: the full run took 19.5 minutes on two idle cores whose compute-only step was 0.13 s, and
30.3 on ones at 0.22-0.29 s (tta.json and tta.md record what it took); ``--quick`` (the
same GPT, T = 6, 16 held-out windows; its losses and ratios mean nothing) under 3 minutes. Needs
root for the namespaces; without it only the loopback runs, and its bytes then count all of the
host's loopback traffic.
"""
import argparse
import copy
import dataclasses
import json
import itertools
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import slowlink  # noqa: E402

RES = os.path.join(HERE, "results")
LO_TX = "/sys/class/net/lo/statistics/tx_bytes"
# (tc rate, label, what it stands for at ~1000x the compute of these cores)
LINKS = [("none", "loopback, unthrottled", "an intra-node link (NVLink class): communication is nearly free"),
         ("160mbit", "160 Mbit/s", "~160 Gbit/s per H100 worker (between a 100G and a 200G NIC per GPU)"),
         ("100mbit", "100 Mbit/s", "~100 Gbit/s per H100 worker (100 GbE per GPU)")]
SIZES = {  # T: fp32's steps (the target's step); runs stop at 2T at the latest
    "full": {"d_model": 128, "heads": 4, "layers": 4, "context": 128, "batch": 16, "T": 80, "warmup": 10,
             "eval_every": 2, "val_windows": 64, "powersgd_start": 10, "steady_from": 15},
    "quick": {"d_model": 128, "heads": 4, "layers": 4, "context": 128, "batch": 16, "T": 6, "warmup": 2,
              "eval_every": 3, "val_windows": 16, "powersgd_start": 2, "steady_from": 3},
}
NEW_CODECS = ("int4", "powersgd")
SMALL_BUCKETS = 512 * 1024  # bytes of float32 per bucket for the "(512 KiB buckets)" runs
PSEUDO = ("compute", "exchange")  # the ratio's two halves, no training run
PEAK_LR, FLOOR, CLIP, SEED = 2e-3, 0.1, 1.0, 0
HVDP_OVER_DDP = 0.7      # throttled links: hvdp's best time to target <= 0.7 x the best DDP method's
AUTO_OVER_DDP = 1.05     # loopback: auto's <= 1.05 x DDP plain's
RATIO_RANGE = (2.0, 5.0)  # fp32 exchange : compute on the throttled links


# ---------------------------------------------------------------- the worker (inside horovodrun)

def hvdp_methods(powersgd_start=0, seed=SEED):
    """(label, codec) of hvdp's contenders: the fixed ones, the new codecs that exist now, auto;
    int8 and int4 also in buckets of ``SMALL_BUCKETS`` bytes (several: their exchange overlaps
    the backward pass). powersgd gets DDP's warm-up (``start_powerSGD_iter``) where it takes one."""
    from hvdp import codecs
    out = [("hvdp none", "none"), ("hvdp bf16", "bf16"), ("hvdp int8", "int8")]
    have = codecs.names()
    for name in (n for n in NEW_CODECS if n in have):
        codec = codecs.get(name)
        fields = {f.name for f in dataclasses.fields(codec)}
        if name == "powersgd" and "rank" in fields:
            warm = {"start_powerSGD_iter": powersgd_start} if "start_powerSGD_iter" in fields else {}
            out += [(f"hvdp powersgd{r}", codec.configure(rank=r, seed=seed, **warm)) for r in (1, 4, 8)]
        else:
            out.append((f"hvdp {name}", codec))
    out += [(f"hvdp {c} (512 KiB buckets)", c) for c in ("int8", "int4") if c in have]
    return out + [("hvdp auto", "auto")]


DDP_HOOKS = [("ddp", "none"), ("ddp+fp16", "fp16"), ("ddp+bf16", "bf16"), ("ddp+powersgd1", "powersgd1"),
             ("ddp+powersgd4", "powersgd4"), ("ddp+powersgd8", "powersgd8")]


def lr_factor(s, T, W):
    """Linear warm-up for W steps, cosine from the peak to FLOOR x the peak at step T, FLOOR after."""
    if s < W:
        return (s + 1) / W
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - W) / max(1, T - W))))


def train_step(opt, model, net, x, y, autocast, hvdp):
    """One training step of the GPT: forward under ``autocast``, backward, the gradients' global
    norm clipped (``net``: the module whose parameters they are), the optimizer's step; an hvdp
    optimizer (``hvdp``) synchronizes first, so the clip sees the averaged gradients. -> loss."""
    import torch.nn.functional as F
    opt.zero_grad()
    with autocast():
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    loss.backward()
    clip_and_step(opt, net, hvdp)
    return loss


def clip_and_step(opt, net, hvdp):
    """After backward: the gradients' global norm clipped, the optimizer's step; an hvdp
    optimizer (``hvdp``) synchronizes first, so the clip sees the averaged gradients."""
    import torch
    if hvdp:
        opt.synchronize()  # the averaged gradients in p.grad: clip the global norm
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        with opt.skip_synchronize():
            opt.step()
    else:  # DDP (averaged once backward returns) and "compute only" (no communication)
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()


class Run:
    """One method's independent training run: its model, optimizer, schedule and records."""

    def __init__(self, label, kind, model, opt, net, limit, codec, size, exchange=None):
        import torch
        self.label, self.kind, self.model, self.opt, self.net = label, kind, model, opt, net
        self.limit, self.codec, self.step, self.exchange = limit, codec, 0, exchange
        self.times, self.wire, self.losses, self.evals, self.eval_s = [], [], [], [], []
        self.reached = None
        if opt is not None:
            self.sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, size["T"], size["warmup"]))

    def train(self, x, y, autocast):
        if self.exchange is not None:  # "exchange only": the gradients' allreduce, no compute
            self.exchange()
            self.step += 1
            return 0.0
        loss = train_step(self.opt, self.model, self.net, x, y, autocast, self.kind in ("hvdp", "horovod"))
        self.sched.step()
        self.step += 1
        return loss.item()


def worker(a):
    import numpy as np
    import torch
    import torch.distributed as dist

    import hvdp.torch as hvd
    from hvdp import codecs
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from torch_gpt import GPT, batch, validate
    from workload_data import stdlib_corpus
    from workload_ddp import init_process_group, wrap

    sz = SIZES[a.size]
    hvd.init()
    torch.set_num_threads(1)
    init_process_group()  # DDP's Gloo group, also the barrier between steps
    torch.manual_seed(a.seed)
    base = GPT(sz["layers"], sz["d_model"], sz["heads"], sz["context"])
    train_data, val = stdlib_corpus()
    vargs = argparse.Namespace(context=sz["context"], val_windows=sz["val_windows"])

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def adamw(params):
        return torch.optim.AdamW(params, lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.1)

    def hvdp_run(label, codec, limit):
        m = copy.deepcopy(base)
        key = label.replace(" ", "_").replace("(", "").replace(")", "")
        policy = hvd.CompressionPolicy(fusion_threshold_bytes=SMALL_BUCKETS) if "KiB buckets" in label else None
        opt = hvd.DistributedOptimizer(adamw(m.parameters()), compression=codec, policy=policy,
                                       named_parameters=[(f"{key}.{k}", p) for k, p in m.named_parameters()])
        return Run(label, "hvdp", m, opt, m, limit, str(codec), sz)

    def tx():
        with open(LO_TX) as f:
            return int(f.read())

    def play(runs, target):
        """Every run one step in turn until each reaches ``target`` or its step limit."""
        active = list(runs)
        while active:
            for r in list(active):
                rng = np.random.default_rng([a.seed, r.step, hvd.rank()])
                x, y = batch(train_data, rng, sz["batch"], sz["context"])
                dist.barrier()
                before, t0 = tx(), time.perf_counter()
                r.losses.append(r.train(x, y, autocast))
                r.times.append(time.perf_counter() - t0)
                dist.barrier()  # both ranks' sends are counted before reading
                r.wire.append((tx() - before) / hvd.size())
                if r.kind not in PSEUDO and (r.step % sz["eval_every"] == 0 or r.step == r.limit):
                    t0 = time.perf_counter()
                    r.evals.append([r.step, validate(r.net, val, vargs, autocast)])
                    r.eval_s.append(time.perf_counter() - t0)
                    if target is not None and r.evals[-1][1] <= target:
                        r.reached = r.step
                if r.reached is not None or r.step >= r.limit:
                    active.remove(r)

    out = {"size": sz, "world": hvd.size(), "params": sum(p.numel() for p in base.parameters()),
           "new_codecs_present": [n for n in NEW_CODECS if n in codecs.names()]}
    target = a.target
    if target is None:  # the target run: float32 alone for T steps
        ref = hvdp_run("fp32 target run", "none", sz["T"])
        play([ref], None)
        target = ref.evals[-1][1] * 1.01
        out["target_run"] = {"evals": ref.evals, "final": ref.evals[-1][1]}
    out["target"] = target
    out["initial_loss"] = validate(base, val, vargs, autocast)  # every run starts from these weights
    limit = 2 * sz["T"]
    runs, refused = [], {}
    only = set(a.only.split(";")) if a.only else None  # a sibling stage's subset (powersgd_parity.py)
    q_seed = a.seed if a.q_seed is None else a.q_seed  # PowerSGD's initial Q (hvdp's and the hook's)
    for label, codec in hvdp_methods(sz["powersgd_start"], q_seed):
        if only is None or label in only:
            runs.append(hvdp_run(label, codec, limit))
    for label, hook in DDP_HOOKS:
        if only is not None and label not in only:
            continue
        try:
            # PowerSGD in one DDP bucket, as in the convergence study: over DDP's default buckets
            # Gloo aborted it here with a collective mismatch ("op.preamble.length <= op.nbytes")
            m, _ = wrap(copy.deepcopy(base), hook, q_seed, sz["powersgd_start"],
                        bucket_cap_mb=1024 if hook.startswith("powersgd") else None)
        except (TypeError, RuntimeError) as e:
            refused[label] = str(e)
            continue
        runs.append(Run(label, "ddp", m, adamw(m.parameters()), m.module, limit, hook, sz))
    if only is not None and "horovod none" in only:  # Horovod's own optimizer, asked for by name only
        import horovod.torch as upstream
        m = copy.deepcopy(base)
        opt = upstream.DistributedOptimizer(adamw(m.parameters()), named_parameters=[
            (f"horovod.{k}", p) for k, p in m.named_parameters()])
        runs.append(Run("horovod none", "horovod", m, opt, m, limit, "none", sz))
    m = copy.deepcopy(base)
    runs.append(Run("compute only", "compute", m, adamw(m.parameters()), m, sz["T"], "-", sz))
    if only is not None:
        runs = [r for r in runs if r.label in only or r.kind == "compute"]
    flat = torch.zeros(out["params"])  # float32 gradients of the GPT as one buffer (fused, as both do)
    n = min(sz["T"], 12)  # the link shapes it: little noise
    runs.append(Run("exchange only (Horovod)", "exchange", None, None, None, n, "fp32 allreduce", sz,
                    exchange=lambda: hvd.allreduce(flat, name="tta.exchange")))
    runs.append(Run("exchange only (DDP's Gloo)", "exchange", None, None, None, n, "fp32 allreduce", sz,
                    exchange=lambda: dist.all_reduce(flat)))
    play(runs, target)
    for i, r in enumerate(runs):  # the slower rank's time of each step
        r.times = hvd.allreduce(torch.tensor(r.times, dtype=torch.float64), op=hvd.Max, name=f"tta.max.{i}").tolist()
    if hvd.rank() != 0:
        return
    out["refused"] = refused
    out["methods"] = {r.label: {"kind": r.kind, "codec": r.codec, "steps": r.step, "reached_step": r.reached,
                                "step_s": r.times, "wire_bytes": r.wire, "train_loss": r.losses,
                                "evals": r.evals, "eval_s": r.eval_s,
                                "phase_ms": r.opt.compression_stats()["phase_ms"] if r.kind == "hvdp" else None}
                      for r in runs}
    with open(a.json_out, "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------- the driver and the report

def summarise(res):
    """Per method: steps and seconds to target (None: not reached), final loss, steady step time,
    MB/step/worker, cumulative seconds at each evaluation; and the link's ratio."""
    sz, target = res["size"], res["target"]
    k0 = sz["steady_from"]
    out = {}
    for label, m in res["methods"].items():
        cum = list(itertools.accumulate(m["step_s"]))
        tail = slice(1, None) if m["kind"] in PSEUDO else slice(min(k0, len(cum) - 1), None)
        steady_t, steady_w = m["step_s"][tail], m["wire_bytes"][tail]
        row = {"kind": m["kind"], "codec": m["codec"], "steps": m["steps"], "reached_step": m["reached_step"],
               "seconds_to_target": cum[m["reached_step"] - 1] if m["reached_step"] else None,
               "final_loss": m["evals"][-1][1] if m["evals"] else None,
               "step_s": statistics.median(steady_t), "mb_per_step": statistics.mean(steady_w) / 1e6,
               "curve": [[0.0, res["initial_loss"]]] + [[cum[s - 1], v] for s, v in m["evals"]],
               "eval_s": sum(m["eval_s"]) / len(m["eval_s"]) if m["eval_s"] else None}
        out[label] = row
    pseudo = {k: out.pop(k)["step_s"] for k in [k for k, r in out.items() if r["kind"] in PSEUDO]}
    compute = pseudo.pop("compute only")
    ratio = {k: v / compute for k, v in pseudo.items()}
    # what overlap with the backward pass does not hide: step time minus compute
    visible = {k: (out[k]["step_s"] - compute) / compute for k in ("hvdp none", "ddp") if k in out}
    ref = res.get("target_run_evals")
    det = None
    if ref and "hvdp none" in res["methods"]:
        mine = {s: v for s, v in res["methods"]["hvdp none"]["evals"]}
        det = all(abs(mine[s] - v) <= 1e-6 * abs(v) for s, v in ref if s in mine)
    return {"methods": out, "compute_s": compute, "exchange_s": pseudo, "exchange_over_compute": ratio,
            "visible_over_compute": visible, "target": target,
            "fp32_deterministic": det}


def run_links(size):
    results, target, ref = {}, None, None
    for rate, label, _ in LINKS:
        isolate = slowlink.unavailable(rate, isolate=True) is None
        why = slowlink.unavailable(rate, isolate=isolate)
        if why or (target is None and rate != "none"):
            results[rate] = {"skipped": why or "no target (the loopback's run did not run)"}
            continue
        args = ["--worker", "--size", size] + ([] if target is None else ["--target", repr(target)])
        t0 = time.time()
        with slowlink.link(rate, isolate=isolate) as (prefix, gbit):
            res = slowlink.run_job(prefix, "tta.py", args, timeout=3600)
        res.update(rate=rate, measured_gbit_s=gbit, isolated=isolate, job_s=time.time() - t0)
        if target is None:
            target, ref = res["target"], res["target_run"]["evals"]
        res["target_run_evals"] = ref
        res["summary"] = summarise(res)
        results[rate] = res
        print(f"{label}: {res['job_s']:.0f} s", file=sys.stderr, flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller GPT and fewer steps (< 3 min), for trying")
    ap.add_argument("--report-only", action="store_true", help="table and plot from the JSON already written")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="full", choices=sorted(SIZES), help=argparse.SUPPRESS)
    ap.add_argument("--target", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=SEED, help=argparse.SUPPRESS)  # weights, batches, PowerSGD's Q
    ap.add_argument("--q-seed", type=int, default=None, help=argparse.SUPPRESS)  # PowerSGD's Q alone
    ap.add_argument("--only", help=argparse.SUPPRESS)  # "label;label": only these methods (and compute only)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    stem = os.path.join(RES, "tta_quick" if a.quick else "tta")
    t0 = time.time()
    if a.report_only:
        with open(stem + ".json") as f:
            saved = json.load(f)
        results, minutes, load = saved["links"], saved["minutes"], saved.get("load")
    else:
        results = run_links("quick" if a.quick else "full")
        minutes, load = (time.time() - t0) / 60, os.getloadavg()[0]
        saved = {"horovod_cycle": slowlink.horovod_cycle(), "bucket": slowlink.BUCKET}
        with open(stem + ".json", "w") as f:
            json.dump(dict(saved, quick=a.quick, minutes=minutes, load=load, links=results), f)
    from tta_report import plot, table, target_rows
    text, notes = table(results)
    mark = {True: "met", False: "NOT met", None: ""}
    rows = target_rows(results)
    target = next((r["target"] for r in results.values() if "target" in r), None)
    head = [f"Target: hvdp none's held-out loss at step T x 1.01 = {target:.4f}" if target else "No target",
            f"(T = {SIZES['quick' if a.quick else 'full']['T']}; a method not there by 2T is not reached). "
            "Seconds: training steps only, the slower rank's, summed. "
            f"The run took {minutes:.1f} min; load average " + (f"{load:.1f} at its end" if load else
                                                                   f"{os.getloadavg()[0]:.1f} when written")
            + f". Horovod's cycle: {slowlink.cycle_words(saved)}. Throttled links: {slowlink.bucket_words(saved)}.",
            ""]
    md = "\n".join(head + notes + ["", text, "", "| target | value | wanted | |", "|---|---|---|---|"]
                   + [f"| {m} | {v} | {t} | {mark[k]} |" for m, v, t, k in rows]) + "\n"
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(results, stem + ".png")
    print(md)
    for m, v, t, k in rows:
        print(f"{mark[k] or '-':8} {m}: {v} (wanted {t})")


if __name__ == "__main__":
    main()
