#!/usr/bin/python3
"""A cluster on one machine: hosts as Linux network namespaces on a switch, each with its own
address and a shaped link, for multi-node runs with a real, limited network between ranks.

    comm/testing/netns_cluster.py [--hosts=2] [--rate=1gbit] [--nodes=K --inter_rate=100mbit]
                                  [--keep_going] -- CMD ARGS...

runs CMD once on every host at once (in its namespace) and exits with the first non-zero exit
code of the hosts (0 when all succeed). In CMD and in the environment of every host:
    {host}  DTRAIN_HOST         the host's index, 0..hosts-1 (use it as --node_rank)
    {addr}  DTRAIN_HOST_ADDR    its address (10.77.0.<host+1>)
    {master_addr} MASTER_ADDR   host 0's address
    {hosts} DTRAIN_HOSTS        the number of hosts (use it as --nnodes)
and GLOO_SOCKET_IFNAME=TP_SOCKET_IFNAME=eth0, so Gloo and TensorPipe use the shaped link.

Topology (all of it inside the cluster's own namespaces: nothing is added to the machine's own
network namespace, and only what this run made is ever removed):
    <id>-sw        the switch: bridge br0 (one per node with --nodes, each joined to a core bridge
                   by a link shaped to --inter_rate), one port per host, shaped to --rate
    <id>-h<i>      host i: eth0 (10.77.0.<i+1>/24, shaped to --rate on the way out) and lo
Every link is shaped in both directions with tc's tbf (`netem` is not needed: no added delay).
Everything is torn down on exit, failure, SIGTERM and Ctrl-C: the processes started in the hosts
are killed, then the namespaces (and with them every link) deleted.

As a library (bench/cluster/run, comm/testing/netns_cluster_test):
    with Cluster(hosts=2, rate="1gbit") as c:
        p = c.popen(0, ["bazel-bin/examples/train", ...], env={...})
        c.set_rate(1, "1mbit"); c.cut(1); c.restore(1)

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), iproute2 and nsenter (util-linux); without them it prints one line saying
so and exits with code 77 (CannotMakeCluster in the library).
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time

EXIT_CANNOT_MAKE = 77  # as automake's "skipped"
SUBNET = "10.77.0."
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class CannotMakeCluster(RuntimeError):
    """Namespaces or links cannot be made here (not root, no iproute2, a sandbox)."""


def rate_bits(rate):
    """'1gbit' -> 1e9. Raises ValueError naming the accepted spellings."""
    m = _RATE.match(rate)
    if not m:
        raise ValueError("rate %r: use a number with bit, kbit, mbit or gbit (e.g. 1gbit, 200mbit)" % rate)
    bits = float(m.group(1)) * _UNIT[m.group(2)]
    if bits < 8e3:
        raise ValueError("rate %r is below 8kbit, too slow for tbf" % rate)
    return bits


NETNS_DIR = "/run/netns"  # where `ip netns add` puts a namespace's handle


def in_ns(ns, argv):
    """argv run inside namespace ns. nsenter switches only the network namespace; `ip netns exec`
    and `ip -n` also remount /sys, which fails in a chroot (Bazel's sandbox in ./bazelw's root)."""
    return ["nsenter", "--net=%s/%s" % (NETNS_DIR, ns)] + list(argv)


def _run(argv, check=True):
    out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and out.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(argv), out.stderr.strip() or "exit %d" % out.returncode))
    return out


class Cluster:
    """hosts: how many; rate: each host's link (both directions); nodes: group the hosts into this
    many nodes (host i in node i * nodes // hosts) joined through a core bridge by links of
    inter_rate; id: the name prefix (default dtc<pid>)."""

    def __init__(self, hosts=2, rate="1gbit", nodes=None, inter_rate=None, id=None):
        if hosts < 1 or hosts > 200:
            raise ValueError("hosts must be in [1, 200], got %d" % hosts)
        if nodes is not None and not 1 <= nodes <= hosts:
            raise ValueError("nodes must be in [1, hosts=%d], got %d" % (hosts, nodes))
        if (nodes is None) != (inter_rate is None):
            raise ValueError("nodes and inter_rate go together: hosts in a node share a fast link, nodes a slow one")
        rate_bits(rate)
        if inter_rate is not None:
            rate_bits(inter_rate)
        self.hosts, self.rate, self.nodes, self.inter_rate = hosts, rate, nodes, inter_rate
        self.id = id or "dtc%d" % os.getpid()
        self.switch = self.id + "-sw"
        self.made = []      # namespaces this cluster made, in order
        self.procs = []     # processes it started
        self._old_handlers = {}

    # --- names -------------------------------------------------------------------------------
    def ns(self, host):
        return "%s-h%d" % (self.id, host)

    def addr(self, host):
        return SUBNET + str(host + 1)

    def node_of(self, host):
        return host * self.nodes // self.hosts if self.nodes else 0

    # --- making and removing -----------------------------------------------------------------
    def __enter__(self):
        self._trap_signals()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _trap_signals(self):
        def stop(signum, frame):
            raise SystemExit(128 + signum)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, stop)
            except ValueError:  # not the main thread: the caller handles signals
                pass

    def _make(self):
        if os.geteuid() != 0:
            raise CannotMakeCluster("netns_cluster: making network namespaces needs root (CAP_NET_ADMIN); "
                                    "run as root or with sudo")
        try:
            _run(["ip", "-V"])
        except (OSError, RuntimeError):
            raise CannotMakeCluster("netns_cluster: `ip` (iproute2) is not installed; install iproute2")
        self._add_ns(self.switch)
        sw = in_ns(self.switch, ["ip"])
        _run(sw + ["link", "set", "lo", "up"])
        bridges = ["br%d" % n for n in range(self.nodes or 1)]
        for br in bridges:
            _run(sw + ["link", "add", br, "type", "bridge"])
            _run(sw + ["link", "set", br, "up"])
        if self.nodes:
            _run(sw + ["link", "add", "core", "type", "bridge"])
            _run(sw + ["link", "set", "core", "up"])
            for n, br in enumerate(bridges):
                up, down = "up%d" % n, "dn%d" % n
                _run(sw + ["link", "add", up, "type", "veth", "peer", "name", down])
                _run(sw + ["link", "set", up, "master", br, "up"])
                _run(sw + ["link", "set", down, "master", "core", "up"])
                self._shape(self.switch, up, self.inter_rate)
                self._shape(self.switch, down, self.inter_rate)
        for h in range(self.hosts):
            ns, port = self.ns(h), "p%d" % h
            self._add_ns(ns)
            _run(sw + ["link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(sw + ["link", "set", port, "master", bridges[self.node_of(h)], "up"])
            hn = in_ns(ns, ["ip"])
            _run(hn + ["addr", "add", self.addr(h) + "/24", "dev", "eth0"])
            _run(hn + ["link", "set", "eth0", "up"])
            _run(hn + ["link", "set", "lo", "up"])
            self._shape(self.switch, port, self.rate)   # into the host
            self._shape(ns, "eth0", self.rate)          # out of the host
        for h in range(1, self.hosts):                  # the switch forwards before anyone waits on it
            self._wait_reachable(0, self.addr(h))

    def _add_ns(self, name):
        out = _run(["ip", "netns", "add", name], check=False)
        if out.returncode != 0:
            raise CannotMakeCluster("netns_cluster: cannot make network namespace %s: %s" % (name, out.stderr.strip()))
        self.made.append(name)

    def _wait_reachable(self, host, addr, timeout=10.0):
        # No ping in a minimal root: a TCP connect to a closed port answers with RST once the
        # path forwards (ECONNREFUSED), and times out while the bridge is still learning.
        code = ("import socket,sys,time\n"
                "end=time.time()+%f\n"
                "while time.time()<end:\n"
                "  s=socket.socket(); s.settimeout(0.5)\n"
                "  try: s.connect((%r,9)); sys.exit(0)\n"
                "  except ConnectionRefusedError: sys.exit(0)\n"
                "  except OSError: time.sleep(0.1)\n"
                "sys.exit(1)\n") % (timeout, addr)
        if _run(in_ns(self.ns(host), [sys.executable, "-c", code]), check=False).returncode != 0:
            raise RuntimeError("netns_cluster: %s cannot reach %s after %.0f s" % (self.ns(host), addr, timeout))

    @staticmethod
    def _burst_bytes(rate):
        # tbf needs a bucket of at least rate / HZ; 4 ms of the rate, at least 32 KiB.
        return max(32 * 1024, int(rate_bits(rate) / 8 * 0.004))

    def _shape(self, ns, dev, rate, verb="add"):
        _run(in_ns(ns, ["tc", "qdisc", verb, "dev", dev, "root", "tbf", "rate", rate,
                        "burst", str(self._burst_bytes(rate)), "latency", "100ms"]))

    def close(self):
        """Kills what the cluster started and deletes what it made; safe to call twice."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self.made):
            # Anything else still running in the namespace (a grandchild that left the group).
            pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", name], check=False)
        self.made = []
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}

    # --- using it ----------------------------------------------------------------------------
    def env(self, host, extra=None):
        e = dict(os.environ)
        e.update({"DTRAIN_HOST": str(host), "DTRAIN_HOST_ADDR": self.addr(host), "DTRAIN_HOSTS": str(self.hosts),
                  "MASTER_ADDR": self.addr(0), "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"})
        e.update(extra or {})
        return e

    def expand(self, host, argv):
        fields = {"host": host, "addr": self.addr(host), "master_addr": self.addr(0), "hosts": self.hosts}
        return [a.format(**fields) if "{" in a else a for a in argv]

    def popen(self, host, argv, env=None, **kwargs):
        """Starts argv (placeholders expanded) in host's namespace, in a process group of its own."""
        p = subprocess.Popen(in_ns(self.ns(host), self.expand(host, argv)),
                             env=self.env(host, env), start_new_session=True, **kwargs)
        self.procs.append(p)
        return p

    def set_rate(self, host, rate):
        """Re-shapes host's link (both directions), e.g. to a crawl."""
        self._shape(self.switch, "p%d" % host, rate, verb="replace")
        self._shape(self.ns(host), "eth0", rate, verb="replace")

    def cut(self, host):
        """Takes host's link down (both ends): packets are dropped, as when a cable is pulled."""
        _run(in_ns(self.switch, ["ip", "link", "set", "p%d" % host, "down"]))
        _run(in_ns(self.ns(host), ["ip", "link", "set", "eth0", "down"]))

    def restore(self, host):
        _run(in_ns(self.ns(host), ["ip", "link", "set", "eth0", "up"]))
        _run(in_ns(self.switch, ["ip", "link", "set", "p%d" % host, "up"]))

    def tx_bytes(self, host):
        """Bytes host has sent on its link so far."""
        out = _run(in_ns(self.ns(host), ["ip", "-s", "-j", "link", "show", "eth0"])).stdout
        import json
        return json.loads(out)[0]["stats64"]["tx"]["bytes"]


def leftovers(prefix):
    """Namespaces whose name starts with prefix (a test's check that nothing was left)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def main(argv):
    if "--" not in argv:
        print("netns_cluster: usage: netns_cluster.py [--hosts=N] [--rate=1gbit] [--nodes=K --inter_rate=R] "
              "-- CMD ARGS...", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog="netns_cluster.py")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--inter_rate")
    ap.add_argument("--keep_going", action="store_true",
                    help="let the other hosts finish when one fails (default: stop them)")
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        print("netns_cluster: no command after --", file=sys.stderr)
        return 2
    try:
        with Cluster(args.hosts, args.rate, args.nodes, args.inter_rate) as c:
            procs = [c.popen(h, cmd) for h in range(args.hosts)]
            first_bad = 0
            while any(p.poll() is None for p in procs):
                bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
                if bad and not first_bad:
                    first_bad = bad[0]
                    if not args.keep_going:
                        break
                time.sleep(0.1)
            codes = [p.poll() for p in procs]
            for h, rc in enumerate(codes):
                if rc not in (0, None):
                    print("netns_cluster: host %d (%s) exited with code %d" % (h, c.addr(h), rc), file=sys.stderr)
            return first_bad or next((rc for rc in codes if rc), 0) or 0
    except CannotMakeCluster as e:
        print(e, file=sys.stderr)
        return EXIT_CANNOT_MAKE
    except ValueError as e:
        print("netns_cluster: %s" % e, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
