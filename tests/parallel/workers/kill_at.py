"""Run an elastic example, SIGKILLing this worker at a named moment once the kill loop arms it.

    python kill_at.py ARM_DIR SCRIPT [ARGS...]

The kill loop (tests/parallel/kill_loop.py) arms a worker by writing ``ARM_DIR/arm-<tag>`` (the
tag of the audit log's pid file: host-localrank-pid) with the name of a moment. When this worker
reaches that moment it removes every arm- file, writes ``ARM_DIR/fired-<tag>`` (moment, time,
tag) and SIGKILLs itself. The moments:

  phase2      a two-phase reduction between its phases: the alltoall done, the allgather not sent
  commit      inside an elastic ``state.commit()``: the state saved, the host check not yet made
  checkpoint  inside ``hvd.save_checkpoint``: half the file's bytes in its temporary file (only the
              rank that writes, rank 0, gets there; the loop arms every worker)
  trial       inside ``compression="auto"``'s trial (hvdp.reduce.chooser), at the start of a step
              that times the probe's proposal (after the uncompressed plan's steps; the others go
              on into the step's reductions and the trial's verdict is never reached)

Test-only: it patches hvdp's recorded collectives, the auto chooser, Horovod's ``State.commit``
and ``torch.save`` in this process, then runs SCRIPT as ``__main__``. With ``compression="auto"``
the probe's proposal is forced to int8 for every bucket (on loopback this small model's probe
proposes no compression, and then no trial runs); the probe and the trial's timings stay real.
"""
import dataclasses
import io
import json
import os
import runpy
import signal
import sys
import time

ARM_DIR = sys.argv[1]
TAG = f"{os.environ.get('HOROVOD_HOSTNAME', 'localhost')}-{os.environ.get('HOROVOD_LOCAL_RANK', '0')}-{os.getpid()}"
ARM = os.path.join(ARM_DIR, "arm-" + TAG)


def armed(moment):
    """Armed for ``moment``: the arm file says "<moment>" or "<moment>@<rank>" (only while this
    worker has that rank)."""
    try:
        with open(ARM) as f:
            what, _, at = f.read().strip().partition("@")
    except OSError:
        return False
    return what == moment and (not at or rank() == int(at))


def rank():
    """This worker's rank now (it changes at each elastic reset), from the Horovod module in use."""
    for name in ("horovod.torch", "horovod.tensorflow"):
        mod = sys.modules.get(name)
        if mod is not None:
            try:
                return mod.rank()
            except ValueError:  # not initialised
                pass
    return None


def fire(moment):
    with open(ARM) as f:
        moment = f.read().strip()  # as armed: "<moment>" or "<moment>@<rank>"
    for name in os.listdir(ARM_DIR):  # one kill per arming: no other worker fires on it later
        if name.startswith("arm-"):
            try:
                os.remove(os.path.join(ARM_DIR, name))
            except OSError:
                pass
    tmp = os.path.join(ARM_DIR, ".tmp-" + TAG)
    with open(tmp, "w") as f:
        json.dump({"moment": moment, "t": time.time(), "worker": TAG, "rank": rank()}, f)
    os.replace(tmp, os.path.join(ARM_DIR, "fired-" + TAG))
    os.kill(os.getpid(), signal.SIGKILL)


def patch_phase2():
    from hvdp.reduce.recorded import Recorded
    allgather = Recorded.allgather_async

    def allgather_async(self, buf, name):
        if name.startswith("hvdp.ag.") and armed("phase2"):
            fire("phase2")
        return allgather(self, buf, name)
    Recorded.allgather_async = allgather_async


def patch_trial():
    from hvdp.reduce import chooser
    decide, ensure = chooser.decide, chooser.Chooser.ensure

    def int8_proposal(buckets, candidates, table, margin=0.05):
        out = decide(buckets, candidates, table, margin)
        int8 = next((c for c in candidates if c.name == "int8"), None)
        if int8 is None or table.world <= 1:
            return out
        return {b: dataclasses.replace(c, codec=int8) for b, c in out.items()}

    def ensure_then_kill(self, *args, **kwargs):
        ensure(self, *args, **kwargs)
        if self.phase is not None and self.phase >= 1 and armed("trial"):
            fire("trial")
    chooser.decide = int8_proposal
    chooser.Chooser.ensure = ensure_then_kill


def patch_commit():
    from horovod.common.elastic import State
    commit = State.commit

    def inside_commit(self):
        if armed("commit"):
            self.save()
            fire("commit")
        return commit(self)
    State.commit = inside_commit


def on_disk(f):
    try:
        f.fileno()
        return True
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError
        return False


def patch_checkpoint():
    try:
        import torch
    except ImportError:  # a Keras job: no torch checkpoints to cut
        return
    save = torch.save

    def half_then_kill(obj, f, *args, **kwargs):
        if on_disk(f) and armed("checkpoint"):  # not the BytesIO of a pickled tensor
            buf = io.BytesIO()
            save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[:len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            fire("checkpoint")
        return save(obj, f, *args, **kwargs)
    torch.save = half_then_kill


if __name__ == "__main__":
    script = sys.argv[2]
    if os.path.basename(script).startswith("torch"):
        patch_checkpoint()
    patch_phase2()
    patch_trial()
    patch_commit()
    sys.argv = sys.argv[2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
