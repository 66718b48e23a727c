import os
import sys

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
