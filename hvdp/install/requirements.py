"""What Horovod's build needs installed in the target environment before it runs (its setup.py
runs there without build isolation): pure decisions from the installed versions."""
from __future__ import annotations

import re
from typing import Dict, Iterable, Optional, Tuple

from .facts import Framework

# Horovod's setup.py runs without build isolation in the target environment; setuptools older
# than 66.1 fails there on Python >= 3.12 (pkgutil.ImpImporter is gone; seen with 65.5.0). The
# upper bound is the development set-up's pin, not a known failure: 84.2.1 (which TF and torch
# pull in) built Horovod here on Python 3.11 (torch 2.14.1), 3.12 and 3.13 (TF 2.21), and 80.10.2
# passes its egg_info on 3.12 (`make compat`, docs/install-horovod.md).
SETUPTOOLS = "setuptools>=66.1,<81"


def _release(version: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def build_requirements(python: str, installed: Dict[str, Optional[str]],
                       frameworks: Iterable[Framework] = ()) -> Tuple[Tuple[str, str], ...]:
    """What Horovod's build needs installed in the target environment first: ((pip spec, why), ...)
    from ``python`` ("3.12.1") and the installed versions (None: absent) of setuptools, wheel,
    packaging and cffi (torch's extension only)."""
    out = []
    have = installed.get("setuptools")
    if have is None:
        out.append((SETUPTOOLS, "setuptools is not installed"))
    elif _release(python)[:2] >= (3, 12) and _release(have) < (66, 1):
        out.append((SETUPTOOLS, f"setuptools {have} fails in Horovod's egg_info on Python {python} "
                                "(pkgutil.ImpImporter was removed in 3.12)"))
    for name, spec in (("wheel", "wheel"), ("packaging", "packaging")):
        if installed.get(name) is None:
            out.append((spec, f"{name} is not installed"))
    if any(f.name == "torch" for f in frameworks) and installed.get("cffi") is None:
        out.append(("cffi>=1.4.0", "cffi is not installed (Horovod's torch extension)"))
    return tuple(out)
