"""Shared by the elastic examples: end a step (record, audit, commit) and the audit log itself.

With ``--log-dir``, each worker writes a pid file (so a test can kill it) and one JSON line per
committed step holding the step's global sample ids; tests/parallel/elastic_harness.py reads
them to check that every sample was trained exactly once per epoch.
"""
import hashlib
import json
import os
import time


class AuditLog:
    def __init__(self, log_dir):
        self.file = None
        if not log_dir:
            return
        os.makedirs(log_dir, exist_ok=True)
        tag = (f"{os.environ.get('HOROVOD_HOSTNAME', 'localhost')}-"
               f"{os.environ.get('HOROVOD_LOCAL_RANK', '0')}-{os.getpid()}")
        with open(os.path.join(log_dir, f"pid-{tag}"), "w") as f:
            f.write(str(os.getpid()))
        self.file = open(os.path.join(log_dir, f"log-{tag}.jsonl"), "a", buffering=1)

    def write(self, **record):
        if self.file:
            self.file.write(json.dumps(record) + "\n")

    def final(self, arrays, size, accuracy, **extra):
        self.write(final=digest(arrays), size=size, test_accuracy=accuracy, **extra)


def digest(arrays):
    """sha256 of the arrays' bytes (numpy arrays), in order."""
    return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()


def end_step(state, block, size, log, sleep=0.0, extra=None, rank=None):
    """``block``: every rank's (sample ids, loss sum) of this step, from allgather_object;
    ``extra``: more fields for this step's record; ``rank``: this worker's rank now (recorded)."""
    state.sampler.record_batch()
    state.commits += 1
    ids = [i for part, _ in block for i in part]
    # logged before commit(): it saves first, then may raise to reset when hosts changed
    log.write(commit=state.commits, epoch=state.epoch, t=time.time(), size=size, rank=rank, ids=ids,
              loss=sum(s for _, s in block) / max(1, len(ids)), **(extra or {}))
    state.commit()
    if sleep:
        time.sleep(sleep)
