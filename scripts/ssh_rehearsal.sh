#!/usr/bin/env bash
# A two-host cluster on one machine, for rehearsing `horovodrun -H a:1,b:1` over real SSH: the
# cluster node's sshd (scripts/ssh_node.sh) with a throw-away host key and user key, listening
# only on loopback, and two host names resolving to loopback addresses that are not the
# machine's own interface addresses, so Horovod and Open MPI treat them as remote hosts and
# start their workers through ssh.
#
#   ssh_rehearsal.sh check                      why it cannot run here (exit 3), else nothing
#   ssh_rehearsal.sh up DIR PORT NAME_A NAME_B  start it; DIR (new, private) keeps all state
#   ssh_rehearsal.sh down DIR                   remove everything `up` made; safe to repeat
#
# Touched outside DIR, each removed by `down` (and by the next `up` if its owner died):
#   /etc/hosts           "127.0.0.2 NAME_A" and "127.0.0.3 NAME_B", tagged "# hvdp-rehearsal DIR"
#   /etc/ssh/ssh_config.d/hvdp-rehearsal-*.conf   for these two names only: the known-hosts file
#                        in DIR (nothing is written to ~/.ssh), batch mode (never a prompt)
#   /run/sshd            sshd's privilege-separation directory, if it was missing
# Environment: HVDP_REHEARSAL_OWNER  pid whose death marks the state as stale (default: parent)
set -euo pipefail
MARK="# hvdp-rehearsal"
DROPIN_DIR=/etc/ssh/ssh_config.d
SSHD=${SSHD:-/usr/sbin/sshd}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=cluster_lib.sh
source "$HERE/cluster_lib.sh"
die() { echo "ssh_rehearsal: $*" >&2; exit 1; }

why_not() {  # the first reason this machine cannot host the rehearsal, or nothing
    [[ $(id -u) -eq 0 ]] || { echo "not root: editing /etc/hosts and running sshd need root"; return; }
    [[ -x "$SSHD" ]] || { echo "$SSHD missing: apt-get install openssh-server (or: make rehearsal)"; return; }
    local t
    for t in ssh ssh-keygen; do
        command -v "$t" >/dev/null || { echo "$t missing: apt-get install openssh-client"; return; }
    done
    [[ -w /etc/hosts ]] || { echo "/etc/hosts is not writable here"; return; }
    grep -qs "^Include $DROPIN_DIR/\*.conf" /etc/ssh/ssh_config \
        || echo "/etc/ssh/ssh_config does not include $DROPIN_DIR/*.conf (needed to keep ~/.ssh untouched)"
}

down() {
    local dir=$1 pid pids=()
    if [[ -f "$dir/node/sshd.pid" ]]; then
        pid=$(cat "$dir/node/sshd.pid")
        # only our own sshd: its command line names this DIR's config
        if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF "$dir/node/sshd_config"; then
            mapfile -t pids < <(echo "$pid"; descendants "$pid")
            kill "${pids[@]}" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "${pids[@]}" 2>/dev/null || break; sleep 0.1; done
            kill -9 "${pids[@]}" 2>/dev/null || true
        fi
    fi
    hosts_without "$MARK $dir"
    rm -f "$DROPIN_DIR/hvdp-rehearsal-$(basename "$dir").conf"
    if [[ -f "$dir/made_privsep" ]] && ! grep -qF "$MARK" /etc/hosts; then
        rmdir /run/sshd 2>/dev/null || true   # the last rehearsal out takes it away
    fi
    rm -rf "$dir"
}

gc() {  # state left by a rehearsal whose owner died (killed before it could clean up)
    local dir owner
    while read -r dir; do
        owner=$(cat "$dir/owner" 2>/dev/null || echo 0)
        kill -0 "$owner" 2>/dev/null || down "$dir"
    done < <(sed -n "s/.*$MARK \(\/[^ ]*\)$/\1/p" /etc/hosts | sort -u)
    local f
    for f in "$DROPIN_DIR"/hvdp-rehearsal-*.conf; do
        [[ -e "$f" ]] || continue
        dir=$(sed -n 's/^# state: //p' "$f")
        [[ -n "$dir" && -d "$dir" ]] || rm -f "$f"
    done
}

up() {
    local dir=$1 port=$2 a=$3 b=$4
    [[ "$port" =~ ^[0-9]+$ && "$port" -gt 1024 && "$port" -lt 65536 ]] || die "PORT '$port' must be 1025..65535"
    [[ "$a" =~ ^[a-z][a-z0-9-]*$ && "$b" =~ ^[a-z][a-z0-9-]*$ && "$a" != "$b" ]] \
        || die "host names must be two different lower-case names, got '$a' '$b'"
    [[ "$dir" == /* && -d "$dir" && -z "$(ls -A "$dir")" ]] || die "DIR '$dir' must be an empty absolute directory"
    local reason; reason=$(why_not)
    [[ -z "$reason" ]] || die "$reason"
    gc
    REH_DIR=$dir
    trap 'down "$REH_DIR"' EXIT   # any failure from here on leaves nothing behind
    chmod 700 "$dir"
    echo "${HVDP_REHEARSAL_OWNER:-$PPID}" > "$dir/owner"

    ssh-keygen -q -t ed25519 -N '' -C hvdp-rehearsal-user -f "$dir/id"
    cp "$dir/id.pub" "$dir/authorized_keys"
    # Pre-trusted host key: no "Permanently added" write, and Open MPI's plain ssh (which has no
    # StrictHostKeyChecking=no, unlike Horovod's) connects without a prompt.
    mkdir -m 700 "$dir/node"
    ssh-keygen -q -t ed25519 -N '' -C hvdp-rehearsal-host -f "$dir/node/host_key"
    echo "[$a]:$port,[$b]:$port $(cut -d' ' -f1,2 "$dir/node/host_key.pub")" > "$dir/known_hosts"
    cat > "$DROPIN_DIR/hvdp-rehearsal-$(basename "$dir").conf" <<EOF
# state: $dir
Host $a $b
    UserKnownHostsFile $dir/known_hosts
    GlobalKnownHostsFile /dev/null
    BatchMode yes
    IdentitiesOnly yes
    IdentityFile $dir/id
EOF
    printf '127.0.0.2 %s %s\n127.0.0.3 %s %s\n' "$a" "$MARK $dir" "$b" "$MARK $dir" >> /etc/hosts
    [[ -d /run/sshd ]] || { mkdir -m 755 /run/sshd; touch "$dir/made_privsep"; }

    # the same sshd set-up a cluster node (the GPU image) runs, here on two loopback addresses
    HVDP_SSH_PORT=$port HVDP_SSH_LISTEN=127.0.0.2,127.0.0.3 HVDP_SSH_DIR=$dir/node \
        HVDP_SSH_AUTHORIZED=$dir/authorized_keys SSHD=$SSHD bash "$HERE/ssh_node.sh" start
    local host
    for host in "$a" "$b"; do
        for _ in $(seq 50); do
            timeout 5 ssh -p "$port" -o ConnectTimeout=2 "$host" true 2>/dev/null && continue 2
            sleep 0.2
        done
        cat "$dir/node/sshd.log" >&2 || true
        timeout 5 ssh -v -p "$port" -o ConnectTimeout=2 "$host" true >&2 || true
        die "no key login to $host:$port within 10 s (sshd log and ssh -v above)"
    done
    trap - EXIT
}

case "${1:-}" in
    check) r=$(why_not); [[ -z "$r" ]] || { echo "$r"; exit 3; } ;;
    up)    [[ $# -eq 5 ]] || die "usage: ssh_rehearsal.sh up DIR PORT NAME_A NAME_B"; up "$2" "$3" "$4" "$5" ;;
    down)  [[ $# -eq 2 && "$2" == /* ]] || die "usage: ssh_rehearsal.sh down DIR (absolute)"; down "$2" ;;
    *)     die "usage: ssh_rehearsal.sh check | up DIR PORT NAME_A NAME_B | down DIR" ;;
esac
