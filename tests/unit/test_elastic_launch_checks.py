"""Elastic launch mistakes fail at once with what to do (no hang)."""
import os
import subprocess
import sys

import pytest

from hvdp.cluster.launch import LaunchError, check_args


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "discover.sh"
    p.write_text("#!/bin/bash\necho localhost:2\necho 127.0.0.1:1\n")
    p.chmod(0o755)
    return str(p)


def elastic(script, *more):
    return ["-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", script, *more,
            "python", "train.py"]


def test_good_elastic_and_plain_launches_pass(script):
    check_args(elastic(script, "--gloo"))
    check_args(["-np", "2", "-H", "localhost:2", "--mpi", "python", "train.py"])


@pytest.mark.parametrize("change,message", [
    (lambda a, s: a + ["--mpi"], "replace --mpi by --gloo"),
    (lambda a, s: [x if x != s else s + ".missing" for x in a], "does not exist"),
    (lambda a, s: (os.chmod(s, 0o644), a)[1], "chmod +x"),
    (lambda a, s: [x if x != "3" else "1" for x in a], "min-np <= max-np"),
    (lambda a, s: ["-np", "5"] + a[2:], "outside"),
    (lambda a, s: (open(s, "w").write("#!/bin/bash\nexit 3\n"), a)[1], "exit 0"),
    (lambda a, s: (open(s, "w").write("#!/bin/bash\necho 'not a host line'\n"), a)[1], "host:slots"),
    (lambda a, s: ["--min-np", "2", "python", "x.py"], "--host-discovery-script"),
])
def test_mistakes_name_the_fix(script, change, message):
    with pytest.raises(LaunchError, match=message.replace("+", r"\+")):
        check_args(change(elastic(script), script))


def test_hanging_discovery_script_times_out(script):
    with open(script, "w") as f:
        f.write("#!/bin/bash\nsleep 30\n")
    with pytest.raises(LaunchError, match="did not answer"):
        check_args(elastic(script), probe_timeout=1)


def test_cli_exits_2_with_the_message(script):
    r = subprocess.run([sys.executable, "-m", "hvdp", "run"] + elastic(script, "--mpi"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "replace --mpi by --gloo" in r.stderr
