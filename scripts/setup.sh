#!/usr/bin/env bash
# Idempotent set-up of hvdp's development environment; `make demo`, `make test` and `.ci/run`
# all start here. Steps (each skipped when already done):
#   1. Debian packages: Open MPI (dev + runtime), cmake, g++ (installed when root, else listed).
#   2. A dependency environment in the cache, keyed by every version it holds: the pins of
#      requirements/deps.txt and a Horovod wheel built by scripts/build_horovod.sh, itself cached
#      by the versions it was built against (Horovod, torch, TF, Python, MPI, the build script).
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

# --- 2. cached dependency environment ---------------------------------------------------------
pin() { sed -n "s/^$1==\([^ ]*\).*/\1/p" "$ROOT/requirements/deps.txt"; }
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
MPIVER=$(mpirun --version 2>/dev/null | head -1 | sed 's/.*) *//')
HVD_VER=${HOROVOD_VERSION:-0.28.1}
BUILD_SHA=$(sha256sum "$ROOT/scripts/build_horovod.sh" | cut -c1-8)
HVD_KEY="horovod$HVD_VER-torch$(pin torch)-tf$(pin tensorflow-cpu)-py$PYVER-ompi$MPIVER-$BUILD_SHA"
ENV_KEY=$(printf '%s\n' "$HVD_KEY" "$(cat "$ROOT/requirements/deps.txt")" | sha256sum | cut -c1-12)
ENV_DIR=$CACHE/envs/$ENV_KEY
WHEEL_DIR=$CACHE/wheels/$HVD_KEY
mkdir -p "$CACHE/envs" "$CACHE/wheels"

exec 9>"$CACHE/.lock"
flock 9   # two clones setting up at once share one build
if [[ ! -f "$ENV_DIR/.complete" ]]; then
    rm -rf "$ENV_DIR"
    say "creating dependency environment $ENV_DIR"
    "$PYTHON" -m venv "$ENV_DIR"
    quiet "$ENV_DIR/bin/pip" install --quiet --upgrade "setuptools<81" wheel
    quiet "$ENV_DIR/bin/pip" install --quiet -r "$ROOT/requirements/deps.txt"
    say "dependencies installed"
    if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
        say "building Horovod $HVD_VER (cache miss: $HVD_KEY); takes a few minutes"
        tmp=$(mktemp -d "$CACHE/wheels/.build.XXXXXX")
        "$ROOT/scripts/build_horovod.sh" "$ENV_DIR/bin/python" "$tmp" > "$tmp.log" 2>&1 \
            || { tail -40 "$tmp.log" >&2; echo "hvdp setup: Horovod build failed, log: $tmp.log" >&2; exit 1; }
        rm -rf "$WHEEL_DIR" && mv "$tmp" "$WHEEL_DIR" && rm -f "$tmp.log"
        say "Horovod wheel cached in $WHEEL_DIR"
    else
        say "Horovod wheel from cache: $WHEEL_DIR"
    fi
    quiet "$ENV_DIR/bin/pip" install --quiet --no-deps "$WHEEL_DIR"/horovod-*.whl
    "$ENV_DIR/bin/horovodrun" --check-build 2>/dev/null | grep -q "\[X\] PyTorch" \
        || { echo "hvdp setup: Horovod installed but PyTorch support missing" >&2; exit 1; }
    touch "$ENV_DIR/.complete"
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
    # The cached environment's commands (horovodrun, pytest, ...) re-pointed at this .venv's
    # python, so that what they start sees hvdp from this clone.
    for f in "$ENV_DIR"/bin/*; do
        name=$(basename "$f")
        [[ -e "$VENV/bin/$name" || "$name" == python* || "$name" == activate* ]] && continue
        if head -1 "$f" | grep -qx "#!$ENV_DIR/bin/python[0-9.]*"; then
            { echo "#!$VENV/bin/python"; tail -n +2 "$f"; } > "$VENV/bin/$name"
            chmod +x "$VENV/bin/$name"
        else
            ln -s "$f" "$VENV/bin/$name"
        fi
    done
    quiet "$VENV/bin/pip" install --quiet --no-deps --no-build-isolation -e "$ROOT"
    echo "$ENV_DIR" > "$VENV/.hvdp-env"
    say ".venv ready (dependencies: $ENV_DIR)"
fi
