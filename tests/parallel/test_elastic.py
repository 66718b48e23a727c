"""Elastic training on fake hosts: a worker killed mid-epoch, and a 2 -> 3 -> 2 resize."""
import pytest

import elastic_harness as eh

pytestmark = pytest.mark.parallel

NUM_TRAIN = 1347  # digits: 1797 samples, 25% held out (examples/torch_digits.load_data)
# the Keras example on both of hvdp.keras's backends
SCRIPTS = ["torch_elastic.py", "keras_elastic.py", "keras_elastic.py@torch"]


def script_env(script):
    """'keras_elastic.py@torch' -> ('keras_elastic.py', {'KERAS_BACKEND': 'torch'})."""
    name, _, backend = script.partition("@")
    return name, ({"KERAS_BACKEND": backend} if backend else {})


GLOO_TIMEOUT_S = 60


@pytest.mark.parametrize("script", SCRIPTS)
def test_fault_worker_killed_mid_epoch(tmp_path, script):
    script, env = script_env(script)
    # the survivors must notice the dead worker from its closed connections, not by waiting out
    # Gloo's timeout (a survivor waiting on the other survivor did, before hvdp's build closed a
    # Gloo context at its first failed connection: docs/install-horovod.md)
    env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(GLOO_TIMEOUT_S)
    schedule = [(0, ["localhost:2", "127.0.0.1:1"])]
    work = tmp_path / "run"
    rc, out, kill_time = eh.run(str(work), schedule, np_=3, kill_host="127.0.0.1", kill_after=40,
                                script=script, timeout=400, env_extra=env)
    if rc != 0 and "gloo::EnforceNotMet" in out:
        # Known, not fixed (README, elastic section): once in four runs here (2026-11-30) a
        # survivor's Gloo transport thread aborted the process (std::terminate on a message-size
        # check) when its peer was killed mid-collective, which Horovod cannot turn into a
        # HorovodInternalError. One more run, in a fresh directory; any other failure, or this
        # one twice, fails the test.
        work = tmp_path / "retry"
        rc, out, kill_time = eh.run(str(work), schedule, np_=3, kill_host="127.0.0.1", kill_after=40,
                                    script=script, timeout=400, env_extra=env)
    assert kill_time is not None
    assert rc == 0, out[-4000:]
    steps, finals = eh.audit(str(work), NUM_TRAIN, 3)
    before = [s for s in steps if s["size"] == 3]
    after = [s for s in steps if s["size"] == 2]  # committed after the reset to 2 workers
    assert before and after and after[0]["t"] > kill_time, "did not continue on 2 workers"
    assert all(s["t"] > kill_time for s in after)
    recovery = after[0]["t"] - kill_time  # kill -> first step committed by the survivors
    assert recovery < GLOO_TIMEOUT_S / 2, f"recovery took {recovery:.1f} s: the survivors waited for Gloo's timeout"
    # continues from the committed state: no jump back to the first steps' loss
    first = sum(s["loss"] for s in steps[:5]) / 5
    assert after[0]["loss"] < 0.5 * first, (after[0]["loss"], first)
    assert after[0]["commit"] == before[-1]["commit"] + 1
    print(f"\nfault run ({script}): kill at commit {before[-1]['commit']}, recovery {recovery:.2f} s, "
          f"{len(steps)} committed steps, losses {first:.3f} -> {after[0]['loss']:.3f}, "
          f"{len(finals)} ranks with identical final parameters")


@pytest.mark.parametrize("script", SCRIPTS)
def test_resize_two_three_two(tmp_path, script):
    script, env = script_env(script)
    schedule = [(0, ["localhost:2"]), (15, ["localhost:2", "127.0.0.1:1"]), (45, ["localhost:2"])]
    rc, out, _ = eh.run(str(tmp_path), schedule, np_=2, step_sleep=0.06, script=script, timeout=400,
                        env_extra=env)
    assert rc == 0, out[-4000:]
    steps, _ = eh.audit(str(tmp_path), NUM_TRAIN, 3)
    sizes = [s["size"] for s in steps]
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2, sizes
    print(f"\nresize run ({script}): sizes by step {sizes[0]} -> {max(sizes)} -> {sizes[-1]}, "
          f"{len(steps)} committed steps")



OUTER_H = 4  # hvd.OuterOptimizer(int8, sync_every=4), DiLoCo's outer SGD (0.7, 0.9, Nesterov)
OUTER_EPOCHS = 2
OUTER_LR = 0.03  # inner SGD, momentum 0.9, batch 16 per worker


def outer_run(work, die_at, script="torch_elastic.py", more=()):
    """An elastic example with outer steps on 3 workers; the worker on 127.0.0.1 kills itself
    (SIGKILL) right after commit ``die_at``. One more run on the known Gloo abort (see
    test_fault_worker_killed_mid_epoch)."""
    script, env = script_env(script)
    extra = ["--outer-every", str(OUTER_H), "--lr", str(OUTER_LR), "--die-at", str(die_at), *more]
    for attempt in ("run", "retry"):
        rc, out, _ = eh.run(str(work / attempt), [(0, ["localhost:2", "127.0.0.1:1"])], np_=3,
                            epochs=OUTER_EPOCHS, extra=extra, timeout=300, script=script, env_extra=env)
        if not (rc != 0 and "gloo::EnforceNotMet" in out):
            break
    assert rc == 0, out[-4000:]
    steps, finals = eh.audit(str(work / attempt), NUM_TRAIN, OUTER_EPOCHS)
    records, _ = eh.read_records(str(work / attempt / "logs"))
    return steps, finals, records


def simulated_outer_run(kill_at=0, workers=3, after=2):
    """The example's training in one process, float32 and exact averages (no int8): the same
    initial model, samples per worker and step (ElasticSampler's split), inner SGD and outer
    Nesterov SGD every H steps; ``kill_at``: after that step the workers are ``after``, every one
    restarting from the global parameters with worker 0's inner state (what hvd.elastic does).
    -> held-out loss of the global parameters at the end."""
    import copy
    import random
    import sys

    import torch
    sys.path.insert(0, eh.os.path.join(eh.ROOT, "examples"))
    from torch_digits import load_data, make_model

    torch.manual_seed(0)
    xtr, ytr, xte, yte = load_data()
    model = make_model()
    glob = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)

    def restart(n, inner_state):
        models = [copy.deepcopy(model) for _ in range(n)]
        opts = [torch.optim.SGD(m.parameters(), lr=OUTER_LR, momentum=0.9) for m in models]
        with torch.no_grad():
            for m, o in zip(models, opts):
                for p, g in zip(m.parameters(), glob):
                    p.copy_(g)
                if inner_state is not None:  # a copy each: load_state_dict keeps the tensors it is given
                    o.load_state_dict(copy.deepcopy(inner_state))
        return models, opts

    models, opts = restart(workers, None)
    step = 0
    for epoch in range(OUTER_EPOCHS):
        order = list(range(len(xtr)))
        random.Random(epoch).shuffle(order)
        start = 0
        while start < len(order):
            block = order[start:start + 16 * len(models)]
            start += len(block)
            for r, (m, o) in enumerate(zip(models, opts)):
                o.zero_grad()
                if block[r::len(models)]:
                    idx = block[r::len(models)]
                    torch.nn.functional.cross_entropy(m(xtr[idx]), ytr[idx]).backward()
                o.step()
            step += 1
            if step % OUTER_H == 0:
                for i, g in enumerate(glob):
                    g.grad = torch.stack([g - list(m.parameters())[i].detach() for m in models]).mean(0)
                outer.step()
                with torch.no_grad():
                    for m in models:
                        for p, g in zip(m.parameters(), glob):
                            p.copy_(g)
            if step == kill_at:
                models, opts = restart(after, opts[0].state_dict())
    with torch.no_grad():
        for p, g in zip(model.parameters(), glob):
            p.copy_(g)
        return torch.nn.functional.cross_entropy(model(xte), yte).item()


def test_outer_steps_worker_killed_mid_interval(tmp_path):
    """hvd.OuterOptimizer in an elastic job: a worker lost in the middle of an interval; the
    survivors go on from the committed outer state and lose nothing else."""
    die_at = 6 * OUTER_H + 2  # 2 inner steps into the 7th interval, in the first epoch
    steps, finals, records = outer_run(tmp_path, die_at)
    before, after = check_outer_chain(steps, finals, records, die_at)
    loss = finals[0]["test_loss"]
    uninterrupted, killed = simulated_outer_run(), simulated_outer_run(kill_at=die_at)
    print(f"\nouter steps, killed after commit {die_at} (H={OUTER_H}, int8): {len(steps)} committed steps "
          f"({len(before)} on 3 workers, {len(after)} on 2), {finals[0]['outer']['outer_steps'][0]} syncs, "
          f"{len(finals)} ranks with identical final parameters; held-out loss {loss:.4f} (accuracy "
          f"{finals[0]['test_accuracy']:.4f}); simulated (float32, no int8): uninterrupted {uninterrupted:.4f}, "
          f"the same kill {killed:.4f}")
    # int8 pseudo-gradients against exact averages (with --compression none the job's held-out
    # loss equalled the simulated kill's to 6 digits: 0.404723). This short run at outer lr 0.7
    # magnifies last-bit differences: runs of the same code ended at 0.4323 or 0.7660 (0.4323 or
    # 0.7638 with HOROVOD_FUSION_THRESHOLD=0), their global parameters first differing in the last
    # bits at the 5th sync, before the kill (the ranks agree within a run; two runs do not, as
    # Horovod does not fix the order of float32 sums across runs). So the loss is checked for
    # training that went right (within a factor 2 of the same kill simulated; untrained: 2.30).
    assert 0.5 * killed <= loss <= 2.0 * killed, (loss, killed)
    assert loss <= 2.0 * uninterrupted, (loss, uninterrupted)


@pytest.mark.parametrize("script", ["keras_elastic.py", "keras_elastic.py@torch"])
def test_keras_outer_steps_worker_killed_mid_interval(tmp_path, script):
    """The same kill with hvdp.keras's hvd.OuterOptimizer and hvd.elastic.KerasState (both Keras
    backends): the survivors go on from the committed outer state, every rank from the global
    parameters."""
    die_at = 6 * OUTER_H + 2
    steps, finals, records = outer_run(tmp_path, die_at, script)
    before, after = check_outer_chain(steps, finals, records, die_at)
    print(f"\n{script}: outer steps, killed after commit {die_at} (H={OUTER_H}, int8): {len(steps)} committed "
          f"steps ({len(before)} on 3 workers, {len(after)} on 2), {finals[0]['outer']['outer_steps'][0]} syncs, "
          f"{len(finals)} ranks with identical final parameters; held-out loss {finals[0]['test_loss']:.4f} "
          f"(accuracy {finals[0]['test_accuracy']:.4f})")
    # it trained (0.84 seen on both backends; untrained: accuracy 0.1, loss 2.30)
    assert finals[0]["test_accuracy"] >= 0.7 and finals[0]["test_loss"] <= 1.2, finals[0]


def test_outer_steps_worker_killed_in_an_int8_warmup(tmp_path):
    """hvd.OuterOptimizer(warmup_steps=12, warmup_compression="int8"): a worker lost inside the
    warm-up, whose steps reduce from the gradient hooks (reductions in flight at the kill); the
    survivors go on from the last commit, the warm-up ends at step 12 of the committed chain."""
    die_at, warm = 6, 12
    steps, finals, records = outer_run(tmp_path, die_at, more=["--warmup-steps", str(warm),
                                                               "--warmup-compression", "int8"])
    before, after = check_outer_chain(steps, finals, records, die_at, warmup=warm)
    print(f"\nouter steps, killed after commit {die_at} inside a warm-up of {warm} int8 steps: {len(steps)} committed "
          f"steps ({len(before)} on 3 workers, {len(after)} on 2), {finals[0]['outer']['outer_steps'][0]} syncs; "
          f"held-out loss {finals[0]['test_loss']:.4f} (accuracy {finals[0]['test_accuracy']:.4f})")
    assert finals[0]["test_accuracy"] >= 0.7 and finals[0]["test_loss"] <= 1.2, finals[0]


def check_outer_chain(steps, finals, records, die_at, warmup=0):
    """What both adapters must show after the kill: every rank's record of a commit holds the same
    outer state; 3 workers up to ``die_at``, 2 from the next commit on; no inner step lost or
    repeated; the global parameters came through the reset; the ranks end identical.
    -> (steps on 3 workers, steps on 2)."""
    # every rank's record of a commit holds the same outer state (counters, global parameters)
    seen = {}
    for r in records:
        seen.setdefault(r["commit"], set()).add(repr(sorted(r["outer"].items())))
    assert all(len(v) == 1 for v in seen.values()), [k for k, v in seen.items() if len(v) > 1]
    before = [s for s in steps if s["size"] == 3]
    after = [s for s in steps if s["size"] == 2]
    assert before[-1]["commit"] == die_at and after and after[0]["commit"] == die_at + 1, \
        ([s["commit"] for s in before[-2:]], [s["commit"] for s in after[:2]])
    # no step lost or repeated by the outer loop: its inner step is the commit, its syncs step // H
    for s in steps:  # (after the warm-up's steps, where there is one)
        warm = min(s["commit"], warmup)
        assert s["outer"].get("warm", 0) == warm and s["outer"]["step"] == s["commit"] - warm, s
        assert s["outer"]["outer_steps"] == [(s["commit"] - warm) // OUTER_H], s
    # the global parameters came through the reset (the first step after it is no sync)
    assert after[0]["outer"]["globals"] == before[-1]["outer"]["globals"]
    # the end: every rank the same global parameters and counters (audit: the same final bits)
    assert len(finals) == 2 and len({repr(sorted(f["outer"].items())) for f in finals}) == 1
    assert finals[0]["outer"]["step"] == steps[-1]["commit"] - warmup
    return before, after
