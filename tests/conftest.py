import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

# flight records that tests' failing jobs dump (hvdp/cluster/flight.py) go to a temporary
# directory, not into the working tree; a test that reads them sets HVDP_FLIGHT_DIR itself
if not os.environ.get("HVDP_FLIGHT_DIR"):
    import tempfile
    os.environ["HVDP_FLIGHT_DIR"] = os.path.join(tempfile.mkdtemp(prefix="hvdp-tests-"), "flight")
