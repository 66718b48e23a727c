"""Delay and reordering for one node's packets to its peer, in user space, for kernels without
tc's netem qdisc (CONFIG_NET_SCH_NETEM not set).

Run inside a node's network namespace. It makes a TUN device, routes the peer's address through
it (a /32, more specific than the veth's /24, so sockets bound to the veth's address use it too),
and sends every IP packet it reads there out of the veth as an Ethernet frame to the peer's MAC,
after a delay: with probability ``reorder`` at once, otherwise after ``delay`` +- ``jitter`` ms
(uniform), so a packet sent at once overtakes the ones held before it (netem's
``delay D J reorder P``, correlation 0). Packets from the peer arrive on the veth as before (the
node's reverse-path filter is turned off for that). Ends on SIGTERM/SIGINT, printing one JSON
line of counts; its TUN device and route go with it.

    ip netns exec NS python delay_relay.py --iface hvdp0 --peer 10.77.0.2 --peer-mac MAC \\
        [--delay-ms 50 --jitter-ms 20 --reorder 0.25 --seed 0]
"""
import argparse
import fcntl
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
ETH_P_IP = 0x0800


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def mac_bytes(mac):
    return bytes(int(x, 16) for x in mac.split(":"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iface", required=True)
    p.add_argument("--peer", required=True, help="the peer node's IPv4 address")
    p.add_argument("--peer-mac", required=True)
    p.add_argument("--tun", default="hvdpdelay")
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--jitter-ms", type=float, default=20.0)
    p.add_argument("--reorder", type=float, default=0.25, help="share of packets sent at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready", help="a file written once the route is in place")
    args = p.parse_args()
    rng = random.Random(args.seed)
    tun = open_tun(args.tun)
    with open(f"/sys/class/net/{args.iface}/address") as f:
        own_mac = f.read().strip()
    header = mac_bytes(args.peer_mac) + mac_bytes(own_mac) + struct.pack("!H", ETH_P_IP)
    out = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    out.bind((args.iface, 0))
    for cmd in (["ip", "link", "set", args.tun, "up", "mtu",
                 open(f"/sys/class/net/{args.iface}/mtu").read().strip()],
                ["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0"],
                ["sysctl", "-qw", f"net.ipv4.conf.{args.iface}.rp_filter=0"],
                ["ip", "route", "replace", f"{args.peer}/32", "dev", args.tun]):
        subprocess.run(cmd, check=True)
    if args.ready:
        with open(args.ready, "w") as f:
            f.write(str(os.getpid()))
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    held, seq, sent, at_once, late, last_sent = [], 0, 0, 0, 0, -1
    while not stop:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            ready, _, _ = select.select([tun], [], [], wait)
        except InterruptedError:
            continue
        if ready:
            while True:
                try:
                    pkt = os.read(tun, 65536)
                except BlockingIOError:
                    break
                now = time.monotonic()
                if rng.random() < args.reorder:
                    due = now
                    at_once += 1
                else:
                    due = now + (args.delay_ms + rng.uniform(-args.jitter_ms, args.jitter_ms)) / 1000.0
                heapq.heappush(held, (due, seq, pkt))
                seq += 1
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, s, pkt = heapq.heappop(held)
            out.send(header + pkt)
            sent += 1
            if s < last_sent:  # a packet that arrived later went out before this one
                late += 1
            last_sent = max(last_sent, s)
    print(json.dumps({"packets": sent, "sent_at_once": at_once, "overtaken": late,
                      "held_at_exit": len(held)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
