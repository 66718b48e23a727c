"""The core package stays framework-free: every module of hvdp/ (found by walking the package, so a
new module is covered without being listed here), imported in a fresh interpreter, leaves torch,
tensorflow, keras and horovod (and their submodules) out of sys.modules. The adapters, which are
installed as hvdp.torch / hvdp.keras but live in adapters/, are not part of the walk."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FRAMEWORKS = ("torch", "tensorflow", "keras", "horovod")

# Run with the repository as the working directory (the hvdp/ of this checkout comes first).
# A meta-path hook notes, for each framework's first import, which hvdp modules were executing
# (innermost last): the chain that pulled it in. The verdict itself is sys.modules afterwards.
PROBE = r"""
import importlib, json, pkgutil, sys, traceback

FRAMEWORKS = %(frameworks)r
first_import = {}    # framework -> hvdp modules being imported then (outermost first)
current = [None]     # the module the walk is importing


class Witness:
    def find_spec(self, name, path=None, target=None):
        root = name.split(".")[0]
        if root in FRAMEWORKS and root not in first_import:
            chain, f = [], sys._getframe(1)
            while f is not None:
                mod = f.f_globals.get("__name__", "")
                if (mod == "hvdp" or mod.startswith("hvdp.")) and (not chain or chain[-1] != mod):
                    chain.append(mod)
                f = f.f_back
            first_import[root] = {"walking": current[0], "chain": chain[::-1]}
        return None


sys.meta_path.insert(0, Witness())
current[0] = "hvdp (the package walk)"
import hvdp

errors, modules = [], ["hvdp"]
for info in pkgutil.walk_packages(hvdp.__path__, "hvdp.",
                                  onerror=lambda name: errors.append([name, traceback.format_exc()])):
    modules.append(info.name)
for name in modules:
    current[0] = name
    try:
        importlib.import_module(name)
    except BaseException:
        errors.append([name, traceback.format_exc()])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in FRAMEWORKS)
print(json.dumps({"modules": modules, "errors": errors, "loaded": loaded, "first": first_import,
                  "hvdp_file": hvdp.__file__}))
"""


@pytest.fixture(scope="module")
def walked():
    r = subprocess.run([sys.executable, "-c", PROBE % {"frameworks": FRAMEWORKS}], cwd=ROOT,
                       capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_no_core_module_imports_a_framework(walked):
    got = walked
    assert os.path.dirname(got["hvdp_file"]) == os.path.join(ROOT, "hvdp"), got["hvdp_file"]
    assert not got["errors"], "core modules that fail to import:\n" + "\n".join(
        f"{name}:\n{tb}" for name, tb in got["errors"])
    pulled = []
    for fw in sorted({m.split(".")[0] for m in got["loaded"]}):
        how = got["first"].get(fw, {})
        chain = how.get("chain") or [how.get("walking") or "?"]
        pulled.append(f"{chain[-1]} pulled in {fw} (import chain: {' -> '.join(chain + [fw])}; "
                      f"the walk was importing {how.get('walking')})")
    assert not pulled, ("the core package hvdp/ must not import torch, tensorflow, keras or horovod "
                        "(move the code into adapters/, or import inside the function that needs it "
                        "from an adapter):\n  " + "\n  ".join(pulled)
                        + f"\n({len(got['loaded'])} framework modules loaded: {', '.join(got['loaded'][:5])}, ...)")


def test_the_walk_covers_every_core_module(walked):
    """Every .py file under hvdp/ is one of the walked modules (a new file, e.g. a new engine
    module or a new subpackage, is covered without editing this test)."""
    got = walked
    on_disk = set()
    for folder, dirs, files in os.walk(os.path.join(ROOT, "hvdp")):
        dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.exists(os.path.join(folder, d, "__init__.py"))]
        rel = os.path.relpath(folder, ROOT).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                on_disk.add(rel if f == "__init__.py" else f"{rel}.{f[:-3]}")
    assert on_disk - set(got["modules"]) == set(), sorted(on_disk - set(got["modules"]))
    assert {"hvdp.codecs", "hvdp.kernels", "hvdp.install", "hvdp.__main__"} <= set(got["modules"])


def test_every_core_package_is_in_the_distribution():
    """setup.cfg lists packages by name: a new folder of hvdp/ left out installs without it
    (a pip-installed hvdp then fails at import; the fresh-venv test finds that in minutes)."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    listed = {p.strip() for p in cfg["options"]["packages"].split(",")}
    found = {"hvdp"} | {"hvdp." + os.path.relpath(d, os.path.join(ROOT, "hvdp")).replace(os.sep, ".")
                        for d, _, files in os.walk(os.path.join(ROOT, "hvdp"))
                        if "__init__.py" in files and d != os.path.join(ROOT, "hvdp")}
    assert found <= listed, f"packages missing from setup.cfg [options] packages: {sorted(found - listed)}"
