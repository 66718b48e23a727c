#!/usr/bin/env bash
# The sshd one node of a Horovod cluster needs, so that `horovodrun -H host1:N,host2:N -p PORT`
# (Gloo: each worker) or Open MPI (its daemon per host) can start processes on it: key-only
# login for the user sshd runs as. It runs without root (a non-root sshd can only log in its own
# user, which is all a launch needs), so the port is unprivileged.
# The GPU image's entry point; also started by scripts/ssh_rehearsal.sh in the multi-host test,
# so the configuration a cluster uses is the one the test suite runs.
#
#   ssh_node.sh start              start sshd in the background; returns once it listens
#   ssh_node.sh run CMD [ARG...]   start, then exec CMD (the image runs `sleep infinity` on
#                                  workers, or a launcher command on the first node)
# Environment:
#   HVDP_SSH_PORT        listening port, default 2222
#   HVDP_SSH_LISTEN      addresses, comma separated, default 0.0.0.0
#   HVDP_SSH_DIR         host key, sshd_config, pid and log; default ~/.ssh/hvdp-node
#   HVDP_SSH_AUTHORIZED  file of public keys allowed to log in; default ~/.ssh/authorized_keys,
#                        filled from ~/.ssh/id_ed25519.pub (the cluster key mounted into every
#                        node) when that exists
set -euo pipefail
SSHD=${SSHD:-/usr/sbin/sshd}
PORT=${HVDP_SSH_PORT:-2222}
LISTEN=${HVDP_SSH_LISTEN:-0.0.0.0}
DIR=${HVDP_SSH_DIR:-$HOME/.ssh/hvdp-node}
AUTH=${HVDP_SSH_AUTHORIZED:-$HOME/.ssh/authorized_keys}
die() { echo "ssh_node: $*" >&2; exit 1; }

start() {
    [[ -x "$SSHD" ]] || die "$SSHD missing: install openssh-server"
    [[ "$PORT" =~ ^[0-9]+$ && "$PORT" -ge 1 && "$PORT" -le 65535 ]] || die "HVDP_SSH_PORT '$PORT' is not a port"
    if [[ $(id -u) -ne 0 && "$PORT" -lt 1024 ]]; then
        die "HVDP_SSH_PORT $PORT needs root; use a port >= 1024 (default 2222)"
    fi
    mkdir -p "$DIR" && chmod 700 "$DIR"
    if [[ ! -s "$AUTH" && -f "$HOME/.ssh/id_ed25519.pub" ]]; then
        mkdir -p "$(dirname "$AUTH")" && cp "$HOME/.ssh/id_ed25519.pub" "$AUTH"
    fi
    [[ -s "$AUTH" ]] || die "no key may log in: mount the cluster key pair as ~/.ssh/id_ed25519{,.pub}" \
        "(ssh-keygen -t ed25519 -N '' -f cluster_key) or set HVDP_SSH_AUTHORIZED"
    # a host key per node, made on first start: an image must not carry one shared secret
    [[ -f "$DIR/host_key" ]] || ssh-keygen -q -t ed25519 -N '' -C "hvdp-node-$(hostname)" -f "$DIR/host_key"
    {
        echo "Port $PORT"
        local a
        for a in ${LISTEN//,/ }; do echo "ListenAddress $a"; done
        cat <<EOF
HostKey $DIR/host_key
PidFile $DIR/sshd.daemon.pid
AuthorizedKeysFile $AUTH
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
X11Forwarding no
AllowTcpForwarding no
PrintMotd no
EOF
    } > "$DIR/sshd_config"
    "$SSHD" -t -f "$DIR/sshd_config" || die "sshd rejected $DIR/sshd_config"
    # -D keeps sshd in the foreground of this background job: $! is the pid to stop it by
    setsid "$SSHD" -D -f "$DIR/sshd_config" -E "$DIR/sshd.log" < /dev/null > /dev/null 2>&1 &
    echo $! > "$DIR/sshd.pid"
    local first=${LISTEN%%,*}
    [[ "$first" == 0.0.0.0 ]] && first=127.0.0.1
    for _ in $(seq 50); do
        (exec 3<>"/dev/tcp/$first/$PORT") 2>/dev/null && return 0
        kill -0 "$(cat "$DIR/sshd.pid")" 2>/dev/null || break
        sleep 0.1
    done
    cat "$DIR/sshd.log" >&2 2>/dev/null || true
    die "sshd did not come up on $first:$PORT (log above)"
}

case "${1:-}" in
    start) start ;;
    run)   shift; [[ $# -gt 0 ]] || die "usage: ssh_node.sh run CMD [ARG...]"; start; exec "$@" ;;
    *)     die "usage: ssh_node.sh start | run CMD [ARG...]" ;;
esac
