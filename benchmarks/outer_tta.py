"""Time to a target loss with outer steps (issue 35): hvdp's ``OuterOptimizer`` (DiLoCo, every H
inner steps, with none/int8/int4 pseudo-gradients, and streaming fragments) beside DDP's
post-local SGD, torchft's DiLoCo (where it runs) and the best per-step methods, on the unthrottled
loopback, 100 Mbit/s and 10 Mbit/s.

    python benchmarks/outer_tta.py [--quick] [--report-only] [--seeds N]
    # -> results/outer_tta.json, outer_tta.md, outer_tta.png

The model is a smaller byte-level GPT than tta.py's (``examples/torch_gpt.py`` with 2 layers,
d=64, context 64: 0.14M parameters, 0.55 MB of float32 gradients, bf16 autocast), so that a
horizon of T = 320 steps (20 outer steps at H = 16) fits for ~25 methods on three links on two
cores. Its compute and its bytes shrink together: the float32 exchange is about 2.5x its compute
at 100 Mbit/s, as tta.py's GPT's is at 100-160 Mbit/s. 2 workers, micro-batch 16 each (global 32),
AdamW (peak lr 2e-3, betas 0.9/0.95, weight decay 0.1), clipping at 1.0, 10 warm-up steps of the
learning rate, then cosine to 0.1 of the peak at step T.

- Every run trains T steps from the same initial weights on the same batches (one per step and
  rank); the runs take turns step by step in the same processes, so the machine's noise hits all
  alike. Held-out loss (64 windows) every 16 steps and at T, not timed.
- Target: fp32 data parallelism's (hvdp none's) held-out loss at T x 1.01 (the loopback job's;
  losses do not depend on the link: hvdp none's evaluations on each link are checked against it).
  Seconds to target: the training steps' time (the slower rank's, summed) up to the first
  evaluation at or under it.
- Outer steps (hvdp, DDP's post-local SGD, torchft's DiLoCo): no synchronous warm-up (hvdp's
  default ``warmup_steps=0``; DDP ``start_localSGD_iter=0``; torchft has none; ``sync_warmup``
  in SIZES sets it for hvdp and DDP alike), a sync every H steps, at the steps kH (PyTorch's
  averager with ``warmup_steps=W + H - 1``), so every evaluation (at multiples of 16) sees the
  ranks' common parameters. hvdp: outer Nesterov SGD lr 0.7, momentum 0.9 (its defaults); DDP's
  post-local SGD averages the parameters (outer lr 1, no momentum: that is what PyTorch offers);
  torchft's DiLoCo: the same outer SGD as hvdp's; "hvdp averaging H int4": hvdp with outer lr 1
  and no momentum (the averaging of DDP's post-local SGD) and int4. Streaming (fragments K, delay tau,
  mix 0): its evaluations see each rank's own parameters on half the windows. Clipping: each
  rank clips its own gradients before the inner step (in hvdp's warm-up, before their average;
  DDP clips the average).
- Per-step methods: hvdp none (fp32 DP) and int4, DDP plain, + fp16 hook, + PowerSGD rank 8
  (warm-up 10 steps, error feedback). At 10 Mbit/s the float32 ones (hvdp none, DDP plain) are
  not run (0.9 s of wire per step: fp16 halves their bytes with the same training, so they cannot
  be the best there).
- "compute only": the same step without any communication: the compute utilisation of a method is
  its median ÷ the method's mean step time (steps after the warm-up).
- Bytes per step: the namespace loopback's transmit counter around each step, / 2 workers.
- Seeds: seed 0 runs everything on every link; seeds 1..N-1 run fp32 DP and hvdp's int8 outer
  methods (H = 4, 8, 16) on the loopback only (for the final held-out loss, which does not depend
  on the link).

Budget: about 30-35 minutes on two idle cores for 3 seeds (``--quick``: T = 32, under 5
minutes, its numbers mean nothing). Needs root for the namespaces.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import slowlink  # noqa: E402
import tta  # noqa: E402  (Run, lr_factor, the constants of the per-step study)

RES = os.path.join(HERE, "results")
LINKS = [("none", "loopback, unthrottled"), ("100mbit", "100 Mbit/s"), ("10mbit", "10 Mbit/s")]
SIZES = {
    "full": {"d_model": 64, "heads": 4, "layers": 2, "context": 64, "batch": 16, "T": 320, "warmup": 10,
             "eval_every": 16, "val_windows": 64, "powersgd_start": 10, "sync_warmup": 0, "H": (4, 8, 16)},
    "quick": {"d_model": 64, "heads": 4, "layers": 2, "context": 64, "batch": 16, "T": 32, "warmup": 2,
              "eval_every": 8, "val_windows": 16, "powersgd_start": 2, "sync_warmup": 0, "H": (4, 8)},
}
SIZES["long"] = {**SIZES["full"], "T": 1280, "eval_every": 64, "H": (8,)}  # outer_horizon.py: 4 x T
DEFAULT = "hvdp outer H8 int8"  # the configuration docs/outer-steps.md shows first
STREAMING = [(16, 4, 1, "int4"), (8, 2, 1, "int4")]  # (H, K, tau, codec)
# targets (issue 35)
OVER_DDP = {"100mbit": 0.6, "10mbit": 0.3}
OVER_TORCHFT = {"100mbit": 1.0, "10mbit": 0.7}
UTILISATION = 0.9
FINAL_LOSS = 0.01
LOOPBACK_OVER_NONE = 1.05


def methods(sz, rate, full):
    """(label, kind, spec) of the runs on this link; ``full`` False: the extra seeds' subset."""
    out = [("fp32 DP (hvdp none)", "hvdp", "none")] if rate != "10mbit" else []
    for H in sz["H"]:
        for codec in ("none", "int8", "int4") if full else ("int8",):
            out.append((f"hvdp outer H{H} {codec}", "outer", {"H": H, "codec": codec}))
    if full:  # outer SGD lr 1 without momentum: the parameters averaged, as DDP's post-local SGD
        out += [(f"hvdp averaging H{H} int4", "outer", {"H": H, "codec": "int4", "lr": 1.0, "momentum": 0.0})
                for H in sz["H"]]
    for H, K, tau, codec in STREAMING:
        if H in sz["H"] and full:
            out.append((f"hvdp streaming H{H} K{K} tau{tau} {codec}", "outer",
                        {"H": H, "codec": codec, "K": K, "tau": tau}))
    if not full:
        return out
    out += [("hvdp int4", "hvdp", "int4")]
    out += [("ddp", "ddp", "none")] if rate != "10mbit" else []
    out += [("ddp+fp16", "ddp", "fp16"), ("ddp+powersgd8", "ddp", "powersgd8")]
    out += [(f"ddp post-local SGD H{H}", "postlocal", {"H": H}) for H in sz["H"]]
    out += [(f"torchft DiLoCo H{H}", "torchft", {"H": H}) for H in sz["H"]]
    return out + [("compute only", "compute", None)]


# ---------------------------------------------------------------- the worker (inside horovodrun)

class _Averaged:
    """An inner optimizer whose step first averages the gradients in float32 (one Gloo allreduce
    of the flat gradients, on the DDP group): the synchronous warm-up of :class:`TorchftRun`."""

    def __init__(self, opt):
        self.opt = opt

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        import torch
        import torch.distributed as dist
        params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
            off += p.numel()
        self.opt.step()


class TorchftRun(tta.Run):
    """torchft's DiLoCo after W synchronous warm-up steps (torchft has no warm-up of its own): for
    the first W steps each rank clips its own gradients (tta.train_step), they are averaged
    (:class:`_Averaged`) and the inner optimizer steps, as hvdp's ``warmup_steps=W`` does; then
    torchft's ``DiLoCo`` is built (it saves the parameters the warm-up reached as its first global
    copy) and syncs every H inner steps from there, at the steps W + kH. ``start()`` builds it
    (collective); W = 0 builds at once."""

    def __init__(self, label, m, inner, sz, W, start):
        super().__init__(label, "torchft", m, inner, m, sz["T"], "none", sz)
        self.W, self.start = W, start
        self.tft = None if W else start()
        if W:
            self.opt = _Averaged(inner)

    def prepare(self):
        if self.tft is None and self.step >= self.W:
            self.opt = self.opt.opt  # torchft's hook is on the inner optimizer's step
            self.tft = self.start()


def worker(a):
    import numpy as np
    import torch
    import torch.distributed as dist

    import hvdp.torch as hvd
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from torch_gpt import GPT, batch, validate
    from workload_data import stdlib_corpus
    from workload_ddp import init_process_group, wrap

    sz = SIZES[a.size]
    T, W = sz["T"], sz["sync_warmup"]
    hvd.init()
    torch.set_num_threads(1)
    init_process_group()  # DDP's Gloo group, also the barrier between steps
    torch.manual_seed(a.seed)
    base = GPT(sz["layers"], sz["d_model"], sz["heads"], sz["context"])
    train_data, val = stdlib_corpus()
    vargs = argparse.Namespace(context=sz["context"], val_windows=sz["val_windows"])
    own_group, _ = dist.new_subgroups(group_size=1)  # post-local SGD's subgroup: each rank a "node"

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def adamw(params):
        return torch.optim.AdamW(params, lr=tta.PEAK_LR, betas=(0.9, 0.95), weight_decay=0.1)

    def named(m, label):
        key = label.replace(" ", "_")
        return [(f"{key}.{k}", p) for k, p in m.named_parameters()]

    def make(label, kind, spec):
        m = copy.deepcopy(base)
        if kind == "hvdp":
            opt = hvd.DistributedOptimizer(adamw(m.parameters()), compression=spec, named_parameters=named(m, label))
            return tta.Run(label, "hvdp", m, opt, m, T, spec, sz)
        if kind == "outer":
            os.environ["HVDP_OVERLAP"] = "1" if spec.get("overlap", True) else "0"  # read when made
            opt = hvd.OuterOptimizer(adamw(m.parameters()), named_parameters=named(m, label), sync_every=spec["H"],
                                     compression=spec["codec"], fragments=spec.get("K", 1), delay=spec.get("tau", 0),
                                     warmup_steps=spec.get("W", W), outer_lr=spec.get("lr", 0.7),
                                     outer_momentum=spec.get("momentum", 0.9), nesterov=spec.get("momentum", 0.9) > 0,
                                     warmup_compression=spec.get("warm", "none"))
            os.environ.pop("HVDP_OVERLAP")
            return tta.Run(label, "outer", m, opt, m, T, spec["codec"], sz)
        if kind == "ddp":
            d, _ = wrap(m, spec, a.seed, sz["powersgd_start"],
                        bucket_cap_mb=1024 if spec.startswith("powersgd") else None)
            return tta.Run(label, "ddp", d, adamw(d.parameters()), d.module, T, spec, sz)
        if kind == "postlocal":
            from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pls
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
            from torch.distributed.optim import PostLocalSGDOptimizer
            d = torch.nn.parallel.DistributedDataParallel(m, broadcast_buffers=False)
            w = spec.get("W", W)  # a stage's own warm-up (outer_warmup.py)
            d.register_comm_hook(pls.PostLocalSGDState(process_group=None, subgroup=own_group,
                                                       start_localSGD_iter=w), pls.post_localSGD_hook)
            opt = PostLocalSGDOptimizer(adamw(d.parameters()),
                                        PeriodicModelAverager(period=spec["H"], warmup_steps=w + spec["H"] - 1))
            return tta.Run(label, "postlocal", d, opt, m, T, "fp32 averaging", sz)
        if kind == "torchft":  # torchft as shipped (one allreduce per tensor), outer SGD as hvdp's
            import torchft_diloco
            inner = adamw(m.parameters())

            def start():
                tft = torchft_diloco.build(m, inner, torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9,
                                                                      nesterov=True), sync_every=spec["H"])
                tft.__enter__()  # its hook on inner.step() until the end of the run
                return tft
            return TorchftRun(label, m, inner, sz, spec.get("W", 0), start)
        opt = adamw(m.parameters())
        return tta.Run(label, "compute", m, opt, m, T, "-", sz)

    def tx():
        with open(tta.LO_TX) as f:
            return int(f.read())

    out = {"size": {k: v for k, v in sz.items()}, "seed": a.seed, "world": hvd.size(),
           "params": sum(p.numel() for p in base.parameters()), "refused": {}}
    out["initial_loss"] = validate(base, val, vargs, autocast)
    runs = []
    plan = methods(sz, a.rate, a.full) if a.methods is None else sibling_methods(a.methods)(sz, a.rate)
    for label, kind, spec in plan:
        try:
            runs.append(make(label, kind, spec))
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here: its reason is reported
            if kind != "torchft":
                raise
            out["refused"][label] = f"{type(e).__name__}: {e}"[:400]
    for step in range(T):
        for r in runs:
            if isinstance(r, TorchftRun):
                r.prepare()  # torchft's DiLoCo built after its warm-up (collective; not timed)
            rng = np.random.default_rng([a.seed, step, hvd.rank()])
            x, y = batch(train_data, rng, sz["batch"], sz["context"])
            dist.barrier()
            before, t0 = tx(), time.perf_counter()
            r.losses.append(r.train(x, y, autocast))
            r.times.append(time.perf_counter() - t0)
            dist.barrier()
            r.wire.append((tx() - before) / hvd.size())
            if r.kind != "compute" and (r.step % sz["eval_every"] == 0 or r.step == T):
                t0 = time.perf_counter()
                r.evals.append([r.step, validate(r.net, val, vargs, autocast)])
                r.eval_s.append(time.perf_counter() - t0)
    for r in runs:
        if getattr(r, "tft", None) is not None:
            r.tft.__exit__(None, None, None)
            r.tft.close()  # collective
    for i, r in enumerate(runs):
        r.times = hvd.allreduce(torch.tensor(r.times, dtype=torch.float64), op=hvd.Max,
                                name=f"outer_tta.max.{i}").tolist()
    same = {}
    for r in runs:  # outer methods without a delay: the ranks' parameters after the last sync
        if r.kind in ("outer", "postlocal", "torchft") and "tau" not in r.label:
            flat = torch.cat([p.detach().reshape(-1) for p in r.net.parameters()])
            every = hvd.allgather_object(flat, name=f"outer_tta.same.{r.label}")
            same[r.label] = all(torch.equal(every[0], f) for f in every)
    if hvd.rank() != 0:
        return
    out["ranks_identical_at_T"] = same
    out["methods"] = {r.label: {"kind": r.kind, "codec": r.codec, "steps": r.step, "step_s": r.times,
                                "wire_bytes": r.wire, "train_loss": r.losses, "evals": r.evals, "eval_s": r.eval_s}
                      for r in runs}
    with open(a.json_out, "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------- the driver and the report

def sibling_methods(name):
    """A sibling stage's method list, "module" (its ``methods``) or "module:function"."""
    mod, _, fn = name.partition(":")
    return getattr(__import__(mod), fn or "methods")


def summarise(res, target):
    sz = res["size"]
    k0 = sz["sync_warmup"] + sz["eval_every"]  # the first steps make engines and caches
    rows = {}
    for label, m in res["methods"].items():
        cum, acc = [], 0.0
        for t in m["step_s"]:
            acc += t
            cum.append(acc)
        reached = next((s for s, v in m["evals"] if v <= target), None) if m["evals"] else None
        tail = m["step_s"][k0:] or m["step_s"]
        rows[label] = {"kind": m["kind"], "codec": m["codec"], "reached_step": reached,
                       "seconds_to_target": cum[reached - 1] if reached else None,
                       "final_loss": m["evals"][-1][1] if m["evals"] else None,
                       "step_median": statistics.median(tail), "step_mean": statistics.mean(tail),
                       "mb_per_step": statistics.mean(m["wire_bytes"][k0:] or m["wire_bytes"]) / 1e6,
                       "train_s": cum[-1],
                       "curve": [[0.0, res["initial_loss"]]] + [[cum[s - 1], v] for s, v in m["evals"]]}
    compute = rows.pop("compute only", None)
    if compute:
        for r in rows.values():
            r["utilisation"] = compute["step_median"] / r["step_mean"]
            # against compute's own mean: the machine's noise (slow steps) on both sides
            r["utilisation_of_means"] = compute["step_mean"] / r["step_mean"]
    return {"methods": rows, "compute_s": compute["step_median"] if compute else None,
            "compute_mean_s": compute["step_mean"] if compute else None}


def run_links(size, seeds):
    import torchft_diloco
    results = {"links": {}, "target": None, "final_losses": {}}
    why = torchft_diloco.ensure_installed()  # its workers then report what failed, if anything
    if why:
        print(f"torchft: {why}", file=sys.stderr)
    ref = None
    jobs = [(rate, label, 0, True) for rate, label in LINKS] + [("none", "loopback", s, False) for s in range(1, seeds)]
    for rate, label, seed, full in jobs:
        isolate = slowlink.unavailable(rate, isolate=True) is None
        why = slowlink.unavailable(rate, isolate=isolate)
        if why:
            results["links"][rate] = {"skipped": why}
            continue
        args = ["--worker", "--size", size, "--rate", rate, "--seed", str(seed)] + (["--full"] if full else [])
        t0 = time.time()
        with slowlink.link(rate, isolate=isolate) as (prefix, gbit):
            res = slowlink.run_job(prefix, "outer_tta.py", args, timeout=3600)
        res.update(rate=rate, measured_gbit_s=gbit, job_s=time.time() - t0)
        if rate == "none":  # the final held-out loss of each seed (it does not depend on the link)
            for k, m in res["methods"].items():
                if m["kind"] != "compute" and m["evals"]:
                    results["final_losses"].setdefault(k, []).append(m["evals"][-1][1])
        if seed == 0 and rate == "none":
            ref = res["methods"]["fp32 DP (hvdp none)"]["evals"]
            results["target"] = ref[-1][1] * 1.01
        if seed == 0:
            mine = res["methods"].get("fp32 DP (hvdp none)")
            res["fp32_deterministic"] = (None if mine is None or ref is None else
                                         all(abs(a[1] - b[1]) <= 1e-6 * abs(b[1]) for a, b in zip(mine["evals"], ref)))
            res["summary"] = summarise(res, results["target"])
            results["links"][rate] = res
        print(f"{label} seed {seed}: {res['job_s']:.0f} s", file=sys.stderr, flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 32, H in {4, 8}: for trying (< 5 min)")
    ap.add_argument("--report-only", action="store_true", help="table and plot from the JSON already written")
    ap.add_argument("--seeds", type=int, default=3, help="seeds for the final held-out loss (default 3)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--full", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="full", choices=sorted(SIZES), help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    ap.add_argument("--methods", help=argparse.SUPPRESS)  # a sibling stage's "module[:function]" (sz, rate)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    stem = os.path.join(RES, "outer_tta_quick" if a.quick else "outer_tta")
    t0 = time.time()
    if a.report_only:
        with open(stem + ".json") as f:
            results = json.load(f)
    else:
        results = run_links("quick" if a.quick else "full", a.seeds)
        results.update(minutes=(time.time() - t0) / 60, load=os.getloadavg()[0], bucket=slowlink.BUCKET,
                       horovod_cycle=slowlink.horovod_cycle())
        with open(stem + ".json", "w") as f:
            json.dump(results, f)
    from outer_tta_report import plot, table, target_rows
    text, notes = table(results)
    mark = {True: "met", False: "NOT met", None: ""}
    rows = target_rows(results)
    sz = SIZES["quick" if a.quick else "full"]
    head = [f"Target: fp32 DP's held-out loss at step T x 1.01 = {results['target']:.4f} (T = {sz['T']}: "
            f"{sz['T'] // max(sz['H'])} outer steps at H = {max(sz['H'])}). Seconds: training steps only, the slower "
            f"rank's, summed. The run took {results['minutes']:.1f} min; load average "
            f"{results.get('load', os.getloadavg()[0]):.1f} at its end. Default configuration: {DEFAULT} (outer "
            f"Nesterov SGD lr 0.7, momentum 0.9; every outer run: {sz['sync_warmup']} synchronous warm-up steps). "
            "Throttled links: "
            f"{slowlink.bucket_words(results)}. Horovod's cycle: {slowlink.cycle_words(results)}.", ""]
    md = "\n".join(head + notes + ["", text, "", "| target | value | wanted | |", "|---|---|---|---|"]
                   + [f"| {m} | {v} | {t} | {mark[k]} |" for m, v, t, k in rows]) + "\n"
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(results, stem + ".png")
    print(md)


if __name__ == "__main__":
    main()
