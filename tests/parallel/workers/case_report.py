"""How a disagreement worker reports: one 'ERROR rank=<r> after=<s>s type=<T> msg=<json>' line
(what tests/parallel/test_disagreement.py parses), or 'DONE rank=<r>'."""
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
