"""`make test` runs test files beside each other (pytest-xdist, tests/conftest.py). A test file that
starts what edits the whole machine's state (scripts/two_node.sh, scripts/ssh_rehearsal.sh: lines
in /etc/hosts, ssh client configuration), directly or through a helper module of tests/, must be in
conftest's MACHINE_WIDE, so that no two of them run at once."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = ("two_node.sh", "ssh_rehearsal.sh")


def machine_wide_setting():
    """tests/conftest.py's MACHINE_WIDE, read from its source (in a whole-suite run the module named
    ``conftest`` may be tests/parallel's)."""
    with open(os.path.join(ROOT, "tests", "conftest.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["MACHINE_WIDE"]:
            return ast.literal_eval(node.value)
    raise AssertionError("tests/conftest.py has no MACHINE_WIDE")


def python_files():
    """{module name: (path, text)} of every .py file under tests/."""
    found = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, "tests")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    found[f[:-3]] = (path, fh.read())
    return found


def machine_wide_files(files):
    """Test files that reach one of SCRIPTS: named in them, or in a module they import (and so on)."""
    reach = {name for name, (_, text) in files.items() if any(s in text for s in SCRIPTS)}
    while True:
        more = {name for name, (_, text) in files.items() if name not in reach and any(
            re.search(rf"^\s*(from|import)\s+{re.escape(m)}\b", text, re.M) for m in reach)}
        if not more:
            break
        reach |= more
    return {name + ".py" for name in reach if name.startswith("test_")}


def test_machine_wide_test_files_share_one_unit_of_work():
    files = python_files()
    del files["test_suite_workers"]  # this file names the scripts too
    found = machine_wide_files(files)
    setting = machine_wide_setting()
    assert found == setting, (
        f"test files reaching {SCRIPTS}: {sorted(found)}; tests/conftest.py MACHINE_WIDE: "
        f"{sorted(setting)} (add a new one there)")


def test_a_test_file_reaching_the_scripts_through_a_helper_is_found():
    files = {
        "helper": ("h.py", 'SCRIPT = "scripts/two_node.sh"'),
        "wrapper": ("w.py", "from helper import Cluster"),
        "test_far": ("test_far.py", "import wrapper\n"),
        "test_near": ("test_near.py", "x = 'ssh_rehearsal.sh'"),
        "test_other": ("test_other.py", "import helpers_not_this_one\n# helper\n"),
    }
    assert machine_wide_files(files) == {"test_far.py", "test_near.py"}
