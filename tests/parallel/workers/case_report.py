"""How a disagreement worker reports: one 'ERROR rank=<r> after=<s>s type=<T> msg=<json>' line
(what tests/parallel/test_disagreement.py parses), or 'DONE rank=<r>'; with several cases in one
job (``run_cases``) each line starts 'case=<name> '."""
import json
import os
import sys
import time


def _run_one(run, case, rank, prefix=""):
    """``run(case, rank)``, reported: an exception in one write (so that horovodrun's line tags
    cannot split it), then re-raised; else 'DONE'."""
    t0 = time.time()
    try:
        run(case, rank)
    except Exception as e:
        sys.stdout.write(f"{prefix}ERROR rank={rank} after={time.time() - t0:.2f}s type={type(e).__name__} "
                         f"msg={json.dumps(str(e))}\n")
        sys.stdout.flush()
        raise
    print(f"{prefix}DONE rank={rank}", flush=True)


def run_and_report(run, case, rank):
    """One case: its exception is reported, then re-raised so that the job fails."""
    _run_one(run, case, rank)


def run_cases(run, cases, rank, barrier):
    """Several cases in one job, in order (each launch costs seconds of start-up): each case's
    exception is reported and the next case runs. For cases whose error every rank raises at the
    same collective (the ranks-agree check), so Horovod stays usable; ``barrier()`` between cases."""
    for case in cases:
        try:
            _run_one(run, case, rank, prefix=f"case={case} ")
        except Exception:
            pass  # reported; the next case
        barrier()


def run_named_checks(checks, names, rank):
    """The checks named (all of ``checks`` when none), in order: 'CHECK <name> OK rank=<r>' after
    each; the first that raises ends the job (the ones after it are not reported)."""
    for name in names or list(checks):
        checks[name]()
        print(f"CHECK {name} OK rank={rank()}", flush=True)


def stalled_call(rank, call):
    """Rank 1 sleeps (``STALL_S``, default 120 s: past the job; e.g. a long evaluation on one rank
    only) before ``call()``, which the others make at once; every rank prints 'CALL rank=<r>
    took=<s>s end=<wall time>' when its call ends (returned or raised): the time the test bounds."""
    if rank == 1:
        time.sleep(float(os.environ.get("STALL_S", "120")))
    t = time.monotonic()
    try:
        return call()
    finally:
        print(f"CALL rank={rank} took={time.monotonic() - t:.2f}s end={time.time():.3f}", flush=True)
