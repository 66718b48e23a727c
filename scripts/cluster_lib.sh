# Shell helpers shared by the one-machine clusters (ssh_rehearsal.sh, two_node.sh); sourced.

hosts_without() {  # rewrite /etc/hosts in place (often a bind mount, and two_node.sh's lock: no rename)
    local kept
    kept=$(grep -vF "$1" /etc/hosts || true)
    printf '%s\n' "$kept" > /etc/hosts
}

descendants() {  # pids below $1: ssh sessions (and what they started) outlive their sshd
    local c
    for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done
}
