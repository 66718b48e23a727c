"""How a disagreement worker reports: one 'ERROR rank=<r> after=<s>s type=<T> msg=<json>' line
(what tests/parallel/test_disagreement.py parses), or 'DONE rank=<r>'; with several cases in one
job (``run_cases``) each line starts 'case=<name> '."""
import json
import sys
import time


def run_and_report(run, case, rank):
    """``run(case, rank)``; an exception is reported in one write (so that horovodrun's line tags
    cannot split it), then re-raised so that the job fails."""
    t0 = time.time()
    try:
        run(case, rank)
    except Exception as e:
        sys.stdout.write(f"ERROR rank={rank} after={time.time() - t0:.2f}s type={type(e).__name__} "
                         f"msg={json.dumps(str(e))}\n")
        sys.stdout.flush()
        raise
    print(f"DONE rank={rank}", flush=True)


def run_cases(run, cases, rank, barrier):
    """Several cases in one job, in order (each launch costs seconds of start-up): each case's
    exception is reported and the next case runs. For cases whose error every rank raises at the
    same collective (the ranks-agree check), so Horovod stays usable; ``barrier()`` between cases."""
    for case in cases:
        t0 = time.time()
        try:
            run(case, rank)
        except Exception as e:
            sys.stdout.write(f"case={case} ERROR rank={rank} after={time.time() - t0:.2f}s "
                             f"type={type(e).__name__} msg={json.dumps(str(e))}\n")
            sys.stdout.flush()
        else:
            print(f"case={case} DONE rank={rank}", flush=True)
        barrier()
