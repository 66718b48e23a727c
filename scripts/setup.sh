#!/usr/bin/env bash
# Idempotent set-up of hvdp's development environment; `make demo`, `make test` and `.ci/run`
# all start here. Steps (each skipped when already done):
#   1. Debian packages: Open MPI (dev + runtime), cmake, g++ (installed when root, else listed).
#   2. A dependency environment in the cache, keyed by every version it holds: the pins of
#      requirements/deps.txt and Horovod from `python -m hvdp install-horovod` (the recipe users
#      run in their own environments), whose wheel is cached by the versions it was built
#      against (Horovod, torch, TF, Python, MPI, the recipe).
#   3. The clone's own light .venv: it sees the cached environment through a .pth file and holds
#      only hvdp itself (editable). A fresh clone on a warm cache is ready in seconds.
# Environment: HVDP_CACHE_DIR (default ~/.cache/hvdp), HVDP_PYTHON (default python3).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${HVDP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdp}
PYTHON=${HVDP_PYTHON:-python3}
T0=$(date +%s)
# pip warns about every extra index location that a machine's pip config names but lacks
quiet() { "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }
say() { printf '[setup %3ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

# --- 1. system packages ----------------------------------------------------------------------
SYS_PKGS=(libopenmpi-dev openmpi-bin cmake g++ make openssh-client)
missing=()
for p in "${SYS_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "hvdp setup: missing system packages: ${missing[*]}" >&2
        echo "  install them as root:  apt-get update && apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    say "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# A Java runtime for Spark (test_spark.py; pyspark runs its JVM): optional, installed when root and
# missing, otherwise that one test skips and says why.
if ! command -v java >/dev/null; then
    if [[ $(id -u) -eq 0 ]]; then
        say "installing default-jre-headless (Java, for Spark's TorchDistributor test)"
        export DEBIAN_FRONTEND=noninteractive
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends default-jre-headless >/dev/null; } \
            || say "Java not installed (test_spark.py will skip)"
    else
        say "no Java runtime (test_spark.py will skip; as root: apt-get install default-jre-headless)"
    fi
fi

# --- 2. cached dependency environment ---------------------------------------------------------
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
MPIVER=$(mpirun --version 2>/dev/null | head -1 | sed 's/.*) *//')
ENV_KEY=$(printf '%s\n' "py$PYVER-ompi$MPIVER" "$(cat "$ROOT/requirements/deps.txt")" | sha256sum | cut -c1-12)
ENV_DIR=$CACHE/envs/$ENV_KEY
# Horovod is (re)installed when the installer's files change; it takes the wheel from the cache
# when its build is unchanged, so that costs seconds.
RECIPE_SHA=$(cat "$ROOT"/hvdp/install/*.py | sha256sum | cut -c1-12)
mkdir -p "$CACHE/envs" "$CACHE/wheels"

exec 9>"$CACHE/.lock"
flock 9   # two clones setting up at once share one build
if [[ ! -f "$ENV_DIR/.deps-complete" ]]; then
    rm -rf "$ENV_DIR"
    say "creating dependency environment $ENV_DIR"
    "$PYTHON" -m venv "$ENV_DIR"
    quiet "$ENV_DIR/bin/pip" install --quiet --upgrade "setuptools<81" wheel
    quiet "$ENV_DIR/bin/pip" install --quiet -r "$ROOT/requirements/deps.txt"
    touch "$ENV_DIR/.deps-complete"
    say "dependencies installed"
fi
if [[ "$(cat "$ENV_DIR/.complete" 2>/dev/null)" != "$RECIPE_SHA" ]]; then
    say "Horovod by python -m hvdp install-horovod (a cached wheel, or a build of a few minutes):"
    # hvdp is not installed in the dependency environment: run its installer from this clone
    PYTHONPATH=$ROOT "$ENV_DIR/bin/python" -m hvdp install-horovod --cache-dir "$CACHE/wheels" \
        || { echo "hvdp setup: python -m hvdp install-horovod failed (above)" >&2; exit 1; }
    echo "$RECIPE_SHA" > "$ENV_DIR/.complete"
fi
# Triton, for the CUDA kernels' tests only (tests/unit/test_kernels_cuda.py runs them on the CPU
# through Triton's interpreter): kept outside the environment, so torch never sees it, and
# optional: without it (no registry) that module skips.
TRITON_DIR=$CACHE/triton/3.5.1
if [[ ! -f "$TRITON_DIR/.complete" ]]; then
    rm -rf "$TRITON_DIR"
    if quiet "$ENV_DIR/bin/pip" install --quiet --no-deps --target "$TRITON_DIR" "triton==3.5.1"; then
        touch "$TRITON_DIR/.complete"
    else
        say "triton not installed (test_kernels_cuda.py will skip)"
    fi
fi
# Ray Train, for tests/parallel/test_ray.py (TorchTrainer running hvdp): added to the environment
# on its own marker, so that a change of its version does not rebuild the whole environment.
RAY_VERSION=2.60.0
if [[ ! -f "$ENV_DIR/.ray-$RAY_VERSION" ]]; then
    say "installing ray[train]==$RAY_VERSION"
    if quiet "$ENV_DIR/bin/pip" install --quiet "ray[train]==$RAY_VERSION"; then
        touch "$ENV_DIR/.ray-$RAY_VERSION"
    else
        say "ray not installed (test_ray.py will skip)"
    fi
fi
# Test-only extras on their own marker (as Ray): Lightning (hvdp.lightning's tests), Hypothesis
# (the codecs' random-input tests), pyspark (Spark's TorchDistributor, test_spark.py). torch stays
# the pinned one (pip keeps what satisfies them).
EXTRAS=(lightning==2.6.6 hypothesis==6.170.17 pyspark==4.3.0)
EXTRAS_KEY=$(printf '%s\n' "${EXTRAS[@]}" | sha256sum | cut -c1-12)
if [[ ! -f "$ENV_DIR/.extras-$EXTRAS_KEY" ]]; then
    say "installing ${EXTRAS[*]}"
    if quiet "$ENV_DIR/bin/pip" install --quiet "${EXTRAS[@]}"; then
        touch "$ENV_DIR/.extras-$EXTRAS_KEY"
    else
        say "test extras not installed (the tests that need them will skip)"
    fi
fi
flock -u 9

# --- 3. the clone's .venv -----------------------------------------------------------------------
VENV=$ROOT/.venv
if [[ "$(cat "$VENV/.hvdp-env" 2>/dev/null)" != "$ENV_DIR" ]]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    dep_site=$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$dep_site" > "$site/hvdp-deps.pth"
    quiet "$VENV/bin/pip" install --quiet --no-deps --no-build-isolation -e "$ROOT"
    echo "$ENV_DIR" > "$VENV/.hvdp-env"
    say ".venv ready (dependencies: $ENV_DIR)"
fi
# The cached environment's commands (horovodrun, pytest, ray, ...) re-pointed at this .venv's
# python, so that what they start sees hvdp from this clone; also those added to the environment
# since the .venv was made.
for f in "$ENV_DIR"/bin/*; do
    name=$(basename "$f")
    [[ -d "$f" || -e "$VENV/bin/$name" || "$name" == python* || "$name" == activate* ]] && continue
    if head -1 "$f" | grep -qx "#!$ENV_DIR/bin/python[0-9.]*"; then
        { echo "#!$VENV/bin/python"; tail -n +2 "$f"; } > "$VENV/bin/$name"
        chmod +x "$VENV/bin/$name"
    else
        ln -s "$f" "$VENV/bin/$name"
    fi
done
if [[ -f "$TRITON_DIR/.complete" ]]; then echo "$TRITON_DIR" > "$VENV/hvdp-triton-path"; fi
