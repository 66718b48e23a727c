import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

# Open MPI busy-polls while a rank waits in a collective (a whole core per waiting rank when its
# slots are not oversubscribed, as horovodrun -H localhost:N declares them); the tests run N ranks
# on 2 cores beside the compute of the others, so a waiting rank yields the core instead. Measured:
# test_join.py's 8 MPI tests 76 s -> 60 s. A job's own environment still decides.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

# flight records that tests' failing jobs dump (hvdp/cluster/flight.py) go to a temporary
# directory, not into the working tree; a test that reads them sets HVDP_FLIGHT_DIR itself
if not os.environ.get("HVDP_FLIGHT_DIR"):
    import tempfile
    os.environ["HVDP_FLIGHT_DIR"] = os.path.join(tempfile.mkdtemp(prefix="hvdp-tests-"), "flight")


# `make test TEST_WORKERS=N` runs the suite in pytest-xdist workers, one test file at a time each (--dist loadfile,
# Makefile TEST_WORKERS), so a file's module-scoped jobs (one horovodrun job serving many checks) run
# once. The files that change what the whole machine shares (/etc/hosts lines, the ssh client's
# configuration: the two-node cluster and the multi-host rehearsal) are one unit of work, so they
# never run beside each other.
MACHINE_WIDE = {"test_two_node.py", "test_multihost.py"}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without it the suite runs in one process
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return "machine-wide" if os.path.basename(path) in MACHINE_WIDE else path

    return ByFile(config, log)
