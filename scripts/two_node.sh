#!/usr/bin/env bash
# Two nodes on one machine, for tests and benchmarks that need real inter-node traffic: two
# network namespaces joined by a veth pair (the "network"), throttled with a tc token bucket on
# both ends, each with the cluster node's sshd (scripts/ssh_node.sh) running in its own UTS
# namespace, so each node has its own host name, addresses and interfaces. Jobs are launched from
# node A (`exec`); Horovod and Open MPI see node A as local and start node B's ranks through ssh.
# Both veth ends are called IFACE (hvdp0), as a cluster's NICs share a name, so one
# `--network-interfaces hvdp0` / `btl_tcp_if_include hvdp0` suits every rank. Inter-node bytes
# are node A's veth counters; ranks on one node talk over loopback or shared memory, not the veth.
#
#   two_node.sh check                 why it cannot run here (exit 3), else nothing
#   two_node.sh up DIR [RATE]         start it; DIR (new, empty, absolute) keeps all state. RATE:
#                                     tc rate of each direction (1gbit, 200mbit, ...), or none;
#                                     default 1gbit
#   two_node.sh exec DIR CMD [ARG...] run CMD on node A (its network, UTS and mount namespaces),
#                                     in the caller's working directory and environment
#   two_node.sh bytes DIR             "tx=N rx=N": bytes node A's veth end sent / received so far
#   two_node.sh speed DIR [SECONDS]   TCP throughput A -> B over the veth (default 1 s), in Mbit/s
#   two_node.sh down DIR              remove everything `up` made; safe to repeat
#
# Nodes:  hvdpnodea 10.77.0.1/24 in netns hvdp-na, hvdpnodeb 10.77.0.2/24 in netns hvdp-nb;
#         sshd on port HVDP_TWO_NODE_PORT (default 2222) of each node's address.
# Launch (as root; tests/parallel/two_node.py builds these), 2 ranks per node:
#   two_node.sh exec DIR horovodrun -np 4 -H hvdpnodea:2,hvdpnodeb:2 -p 2222 --gloo \
#       --network-interfaces hvdp0 python x.py
#   OMPI_MCA_oob_tcp_if_include=hvdp0 two_node.sh exec DIR horovodrun ... --mpi ... (the same)
#   two_node.sh exec DIR mpirun --allow-run-as-root -np 4 -H hvdpnodea:2,hvdpnodeb:2 \
#       -bind-to none -map-by slot -mca pml ob1 -mca btl ^openib,ofi -mca btl_tcp_if_include hvdp0 \
#       -mca oob_tcp_if_include hvdp0 -x OMP_NUM_THREADS -x PATH python x.py
#   (ssh's port comes from the ssh config below, so plain mpirun needs no plm_rsh_args)
# Touched outside DIR, each removed by `down` (and by the next `up` if its owner died):
#   network namespaces hvdp-na, hvdp-nb (/run/netns/hvdp-n?) and the veth pair hvdp0 <-> hvdp0
#                        between them, with a tbf qdisc on each end; the processes in them (the
#                        two sshd, their sessions, jobs started by `exec`) are killed by `down`
#   /etc/hosts           "10.77.0.1 hvdpnodea" and "10.77.0.2 hvdpnodeb", tagged
#                        "# hvdp-two-node DIR" (the namespaces share this file with the machine)
#   /etc/ssh/ssh_config.d/hvdp-two-node.conf   for the two names only: port, the known-hosts file
#                        and user key in DIR (nothing is written to ~/.ssh), batch mode
#   /run/sshd            sshd's privilege-separation directory, if it was missing
# Left in place: /run/netns, which the first `ip netns add` makes (an empty directory bind-mounted
# onto itself, iproute2's own; other users of `ip netns` share it).
# `check` (and `up`) also add and delete a namespace hvdp-probe-PID with a veth pair and a tbf,
# to learn whether this machine allows them. `up` and `down` take a flock on /etc/hosts.
# One cluster per machine (the names are fixed); `up` refuses while another's owner lives.
# Environment: HVDP_TWO_NODE_OWNER  pid whose death marks the state as stale (default: the
#                                   parent, which under `timeout` is timeout: from a shell, $$)
#              PYTHON               interpreter for `speed` (default python3)
#              HVDP_TWO_NODE_PORT   sshd port on each node (default 2222)
set -euo pipefail
MARK="# hvdp-two-node"
DROPIN=/etc/ssh/ssh_config.d/hvdp-two-node.conf
SSHD=${SSHD:-/usr/sbin/sshd}
PORT=${HVDP_TWO_NODE_PORT:-2222}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=cluster_lib.sh
source "$HERE/cluster_lib.sh"
SELF=$HERE/$(basename "${BASH_SOURCE[0]}")
NODES=(a b)
declare -A NS=([a]=hvdp-na [b]=hvdp-nb) HOST=([a]=hvdpnodea [b]=hvdpnodeb) \
    ADDR=([a]=10.77.0.1 [b]=10.77.0.2)
IFACE=hvdp0
SPEED_PORT=5201
die() { echo "two_node: $*" >&2; exit 1; }

why_not() {  # the first reason this machine cannot host the two nodes, or nothing
    [[ $(id -u) -eq 0 ]] || { echo "not root: network namespaces, tc and /etc/hosts need root"; return; }
    local t
    for t in ip tc unshare nsenter flock; do
        command -v "$t" >/dev/null || { echo "$t missing: apt-get install iproute2 util-linux"; return; }
    done
    [[ -x "$SSHD" ]] || { echo "$SSHD missing: apt-get install openssh-server"; return; }
    for t in ssh ssh-keygen; do
        command -v "$t" >/dev/null || { echo "$t missing: apt-get install openssh-client"; return; }
    done
    [[ -w /etc/hosts ]] || { echo "/etc/hosts is not writable here"; return; }
    grep -qs "^Include ${DROPIN%/*}/\*.conf" /etc/ssh/ssh_config \
        || { echo "/etc/ssh/ssh_config does not include ${DROPIN%/*}/*.conf (needed to keep ~/.ssh untouched)"; return; }
    # namespaces, a veth pair and a token bucket: refused in many containers (no CAP_SYS_ADMIN /
    # CAP_NET_ADMIN, no sch_tbf); try them once under a throw-away name
    local probe=hvdp-probe-$$ err
    if ! err=$(ip netns add "$probe" 2>&1); then echo "cannot create a network namespace: $err"; return; fi
    if ! err=$(ip -n "$probe" link add name p0 type veth peer name p1 2>&1); then
        ip netns del "$probe" 2>/dev/null; echo "cannot create a veth pair: $err"; return
    fi
    if ! err=$(tc -n "$probe" qdisc add dev p0 root tbf rate 1gbit burst 64kb latency 25ms 2>&1); then
        ip netns del "$probe" 2>/dev/null; echo "cannot add a tbf qdisc (tc): $err"; return
    fi
    ip netns del "$probe" 2>/dev/null || true
    unshare --uts true 2>/dev/null || echo "cannot create a UTS namespace (unshare --uts)"
}

rate_bits() {  # tc rate -> bits per second, or nothing when it is not one
    local m
    [[ "${1,,}" =~ ^([0-9]+)(bit|kbit|mbit|gbit|tbit)$ ]] || return 0
    case ${BASH_REMATCH[2]} in bit) m=1 ;; kbit) m=1000 ;; mbit) m=1000000 ;; gbit) m=1000000000 ;;
                               tbit) m=1000000000000 ;; esac
    echo $(( BASH_REMATCH[1] * m ))
}

stop() {  # TERM, then KILL after 5 s
    [[ $# -gt 0 ]] || return 0
    kill "$@" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$@" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$@" 2>/dev/null || true
}

sshd_pid() {  # node $2's sshd of cluster $1, if it runs
    local pid
    pid=$(cat "$1/$2/sshd.pid" 2>/dev/null) || return 0
    # only our own sshd: its command line names this DIR's config
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF "$1/$2/sshd_config" && echo "$pid"
    return 0
}

drop_ns() {  # kill what runs in namespace $1, then delete it (its veth end goes with it)
    local pids=()
    ip netns list | grep -qw "^$1" || return 0
    mapfile -t pids < <(ip netns pids "$1" 2>/dev/null)
    stop "${pids[@]}"
    ip netns del "$1" 2>/dev/null || true
}

down() {
    local dir=$1 n pid pids=()
    for n in "${NODES[@]}"; do
        pid=$(sshd_pid "$dir" "$n")
        [[ -z "$pid" ]] || mapfile -t -O "${#pids[@]}" pids < <(echo "$pid"; descendants "$pid")
    done
    stop "${pids[@]}"
    if [[ -f "$dir/made_netns" ]]; then  # the namespaces are this DIR's (names are fixed)
        for n in "${NODES[@]}"; do drop_ns "${NS[$n]}"; done
    fi
    hosts_without "$MARK $dir"
    [[ "$(sed -n 's/^# state: //p' "$DROPIN" 2>/dev/null)" != "$dir" ]] || rm -f "$DROPIN"
    if [[ -f "$dir/made_privsep" ]] && ! grep -qE "# hvdp-(two-node|rehearsal)" /etc/hosts; then
        rmdir /run/sshd 2>/dev/null || true   # the last cluster out takes it away
    fi
    rm -rf "$dir"
}

alive() {  # pid $1 runs (a zombie does not: its owner died, nobody reaped it yet)
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    [[ "${stat##*) }" != Z* && "${stat##*) }" != X* ]]
}

gc() {  # state left by a cluster whose owner died (killed before it could clean up)
    local dir owner n
    while read -r dir; do
        owner=$(cat "$dir/owner" 2>/dev/null || echo 0)
        [[ "$owner" =~ ^[1-9][0-9]*$ ]] && alive "$owner" || down "$dir"
    done < <(sed -n "s/.*$MARK \(\/[^ ]*\)$/\1/p" /etc/hosts | sort -u)
    dir=$(sed -n 's/^# state: //p' "$DROPIN" 2>/dev/null || true)
    [[ -z "$dir" || -d "$dir" ]] || rm -f "$DROPIN"
    dir=$(sed -n "s/.*$MARK \(\/[^ ]*\)$/\1/p" /etc/hosts | head -n1)
    [[ -z "$dir" ]] || die "another two-node cluster is up (state $dir, owner pid $(cat "$dir/owner" 2>/dev/null))"
    # namespaces with no live cluster claiming them: a crash between claim and clean-up
    for n in "${NODES[@]}"; do drop_ns "${NS[$n]}"; done
}

in_node() {  # run $2... in node $1's namespaces (from outside: before/without the sshd)
    local n=$1; shift
    ip netns exec "${NS[$n]}" "$@"
}

up() {
    local dir=$1 rate=$2 bits="" n
    [[ "$PORT" =~ ^[0-9]+$ && "$PORT" -ge 1 && "$PORT" -lt 65536 ]] || die "HVDP_TWO_NODE_PORT '$PORT' is not a port"
    [[ "$rate" == none ]] || bits=$(rate_bits "$rate")
    [[ "$rate" == none || -n "$bits" ]] || die "RATE '$rate' must be like 1gbit, 200mbit, 5000kbit or none"
    [[ "$dir" == /* && -d "$dir" && -z "$(ls -A "$dir")" ]] || die "DIR '$dir' must be an empty absolute directory"
    local reason; reason=$(why_not)
    [[ -z "$reason" ]] || die "$reason"
    gc
    TN_DIR=$dir
    trap 'down "$TN_DIR"' EXIT   # any failure from here on leaves nothing behind
    chmod 700 "$dir"
    echo "${HVDP_TWO_NODE_OWNER:-$PPID}" > "$dir/owner"
    echo "$rate" > "$dir/rate"
    # claim first: from here a crash leaves a tagged line that the next `up` cleans after
    printf '%s %s %s\n' "${ADDR[a]}" "${HOST[a]}" "$MARK $dir" "${ADDR[b]}" "${HOST[b]}" "$MARK $dir" >> /etc/hosts

    ssh-keygen -q -t ed25519 -N '' -C hvdp-two-node-user -f "$dir/id"
    cp "$dir/id.pub" "$dir/authorized_keys"
    # pre-trusted host keys: Open MPI's plain ssh (no StrictHostKeyChecking=no) never prompts
    : > "$dir/known_hosts"
    for n in "${NODES[@]}"; do
        mkdir -m 700 "$dir/$n"
        ssh-keygen -q -t ed25519 -N '' -C "hvdp-two-node-${HOST[$n]}" -f "$dir/$n/host_key"
        echo "[${HOST[$n]}]:$PORT,[${ADDR[$n]}]:$PORT $(cut -d' ' -f1,2 "$dir/$n/host_key.pub")" >> "$dir/known_hosts"
    done
    cat > "$DROPIN" <<EOF
# state: $dir
Host ${HOST[a]} ${HOST[b]} ${ADDR[a]} ${ADDR[b]}
    Port $PORT
    UserKnownHostsFile $dir/known_hosts
    GlobalKnownHostsFile /dev/null
    BatchMode yes
    IdentitiesOnly yes
    IdentityFile $dir/id
EOF
    [[ -d /run/sshd ]] || { mkdir -m 755 /run/sshd; touch "$dir/made_privsep"; }

    # the network: two namespaces, one veth pair made directly inside them (never in the
    # machine's own namespace), loopback up, IPv6 off (no neighbour-discovery chatter on the
    # counters), a token bucket on each end's egress (= each direction)
    touch "$dir/made_netns"
    for n in "${NODES[@]}"; do ip netns add "${NS[$n]}"; done
    ip link add name "$IFACE" netns "${NS[a]}" type veth peer name "$IFACE" netns "${NS[b]}"
    for n in "${NODES[@]}"; do
        ip -n "${NS[$n]}" link set lo up
        in_node "$n" sh -c "echo 1 > /proc/sys/net/ipv6/conf/$IFACE/disable_ipv6" 2>/dev/null || true
        ip -n "${NS[$n]}" addr add "${ADDR[$n]}/24" dev "$IFACE"
        ip -n "${NS[$n]}" link set "$IFACE" up
        if [[ -n "$bits" ]]; then
            # burst: 4 ms at the rate (>= 64 KiB: one GSO packet), queue: 25 ms
            local burst=$(( bits / 8 / 250 )); [[ $burst -ge 65536 ]] || burst=65536
            tc -n "${NS[$n]}" qdisc add dev "$IFACE" root tbf rate "$bits"bit burst "$burst" latency 25ms
        fi
    done

    # the same sshd set-up a cluster node runs, one per node, each in its node's network
    # namespace (and the mount namespace `ip netns exec` makes: /sys shows the node's interfaces)
    # and its own UTS namespace named after the node; fd 9 (the lock) is not theirs to keep
    for n in "${NODES[@]}"; do
        HVDP_SSH_PORT=$PORT HVDP_SSH_LISTEN=${ADDR[$n]} HVDP_SSH_DIR=$dir/$n \
            HVDP_SSH_AUTHORIZED=$dir/authorized_keys SSHD=$SSHD \
            in_node "$n" unshare --uts sh -c 'hostname "$1" && exec bash "$2" start' _ \
            "${HOST[$n]}" "$HERE/ssh_node.sh" 9<&-
    done
    # both logins work from node A, and each lands on its own node
    local got
    for n in "${NODES[@]}"; do
        for _ in $(seq 50); do
            got=$(timeout 5 bash "$SELF" exec "$dir" ssh -o ConnectTimeout=2 "${HOST[$n]}" \
                'echo $(hostname) $(cat /sys/class/net/'"$IFACE"'/address)' 2>/dev/null 9<&-) && break
            sleep 0.2
        done
        if [[ "${got%% *}" != "${HOST[$n]}" ]]; then
            cat "$dir/$n/sshd.log" >&2 || true
            timeout 5 bash "$SELF" exec "$dir" ssh -v -o ConnectTimeout=2 "${HOST[$n]}" hostname >&2 9<&- || true
            die "no key login to ${HOST[$n]}:$PORT from node A within 10 s, got '$got' (sshd log and ssh -v above)"
        fi
    done
    trap - EXIT
}

node_pid() {  # node A's sshd: its namespaces are node A
    local pid; pid=$(sshd_pid "$1" a)
    [[ -n "$pid" ]] || die "no two-node cluster up in '$1'"
    echo "$pid"
}

run_in_a() {  # $1 DIR, then the command
    local pid; pid=$(node_pid "$1"); shift
    exec nsenter -t "$pid" -n -u -m --wd="$PWD" -- "$@"
}

bytes() {
    local pid; pid=$(node_pid "$1")
    # /proc/PID/net/dev: the counters of PID's network namespace, read from outside
    awk -v ifc="$IFACE:" '$1 == ifc { print "tx=" $10 " rx=" $2; found=1 } END { exit !found }' \
        "/proc/$pid/net/dev" || die "no $IFACE in node A"
}

speed() {  # a TCP sender in node A, a receiver in node B; the receiver times the bytes
    local dir=$1 secs=$2 pa pb rate
    pa=$(node_pid "$dir"); pb=$(sshd_pid "$dir" b)
    [[ -n "$pb" ]] || die "node B's sshd is not running"
    rate=$(cat "$dir/rate" 2>/dev/null || echo '?')
    nsenter -t "$pb" -n -u -- "$PYTHON" -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
c, _ = s.accept(); n = 0; t0 = t1 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t1 = time.monotonic(); t0 = t0 or t1; n += len(b)
print(f"A->B {n * 8 / max(t1 - t0, 1e-9) / 1e6:.0f} Mbit/s ({n} bytes in {t1 - t0:.2f} s, rate {sys.argv[3]})")
' "${ADDR[b]}" "$SPEED_PORT" "$rate" 9<&- &
    local server=$!
    nsenter -t "$pa" -n -u -- "$PYTHON" -c '
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError:
        time.sleep(0.05)
else:
    sys.exit("cannot reach the receiver on node B")
buf, end = bytes(1 << 20), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    s.sendall(buf)
s.close()
' "${ADDR[b]}" "$SPEED_PORT" "$secs" || { kill "$server" 2>/dev/null; die "speed: the sender failed"; }
    wait "$server"
}

lock() { exec 9< /etc/hosts; flock -w 120 9 || die "another two_node.sh up/down holds /etc/hosts for 120 s"; }

case "${1:-}" in
    check) r=$(why_not); [[ -z "$r" ]] || { echo "$r"; exit 3; } ;;
    up)    [[ $# -eq 2 || $# -eq 3 ]] || die "usage: two_node.sh up DIR [RATE]"; lock; up "$2" "${3:-1gbit}" ;;
    exec)  [[ $# -ge 3 ]] || die "usage: two_node.sh exec DIR CMD [ARG...]"; d=$2; shift 2; run_in_a "$d" "$@" ;;
    bytes) [[ $# -eq 2 ]] || die "usage: two_node.sh bytes DIR"; bytes "$2" ;;
    speed) [[ $# -eq 2 || $# -eq 3 ]] || die "usage: two_node.sh speed DIR [SECONDS]"; speed "$2" "${3:-1}" ;;
    down)  [[ $# -eq 2 && "$2" == /* ]] || die "usage: two_node.sh down DIR (absolute)"; lock; down "$2" ;;
    *)     die "usage: two_node.sh check | up DIR [RATE] | exec DIR CMD... | bytes DIR | speed DIR [SECONDS] | down DIR" ;;
esac
