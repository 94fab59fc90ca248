#!/usr/bin/python3
"""//comm/testing:netns_cluster_test: the cluster harness makes what it says and removes all of it.

- a link shaped to R carries at most ~R (and most of it), both directions;
- hosts grouped into 2 nodes: inside a node the host rate, across nodes the slower inter_rate;
- set_rate throttles, cut() stops traffic, restore() brings it back;
- after a clean exit, an exception, and SIGTERM to the command-line tool: no namespace with the
  cluster's prefix and no process it started remain; bad arguments are one line and exit 2.
Skipped (passes, printing why) where namespaces cannot be made."""
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import netns_cluster  # noqa: E402

failures = []

# Sends MB megabytes from host FROM to host TO; prints the receiver's Mbit/s.
PROBE = r"""
import os, socket, sys, time
role, addr, mb = sys.argv[1], sys.argv[2], float(sys.argv[3])
if role == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, 5555)); s.listen(1)
    s.settimeout(20); c, _ = s.accept(); c.settimeout(20); n = 0; t = None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        t = t or time.time(); n += len(b)
    print("%.1f" % (n * 8 / 1e6 / (time.time() - t)))
else:
    for _ in range(100):
        try: s = socket.create_connection((addr, 5555), timeout=5); break
        except OSError: time.sleep(0.05)
    s.sendall(b"x" * int(mb * 1e6)); s.close()
"""


def fail(msg):
    print("FAIL: " + msg, flush=True)
    failures.append(msg)


def mbits(c, src, dst, mb):
    recv = c.popen(dst, [sys.executable, "-c", PROBE, "recv", c.addr(dst), str(mb)], stdout=subprocess.PIPE, text=True)
    send = c.popen(src, [sys.executable, "-c", PROBE, "send", c.addr(dst), str(mb)])
    send.wait(timeout=60)
    out = recv.communicate(timeout=60)[0].strip()
    return float(out) if out else 0.0


def expect_rate(what, got, limit):
    # The shaping caps the rate (1.15x: a loaded machine only sends slower); the floor, 0.1x the
    # limit, is 10x under what a quiet machine reaches (about the limit), so load cannot miss it.
    print("%s: %.1f Mbit/s (shaped to %.0f)" % (what, got, limit), flush=True)
    if not 0.1 * limit <= got <= 1.15 * limit:
        fail("%s: %.1f Mbit/s, outside [0.1, 1.15] x %.0f" % (what, got, limit))


def expect_gone(prefix, procs=()):
    left = netns_cluster.leftovers(prefix)
    if left:
        fail("namespaces left behind: %s" % left)
    alive = [p.pid for p in procs if p.poll() is None]
    if alive:
        fail("processes left running: %s" % alive)


def main():
    pid = os.getpid()
    try:
        with netns_cluster.Cluster(hosts=1, id="dtcp%d" % pid):
            pass
    except netns_cluster.CannotMakeCluster as e:
        print("SKIPPED: %s" % e)
        return 0
    expect_gone("dtcp%d" % pid)

    prefix = "dtcn%d" % pid
    with netns_cluster.Cluster(hosts=4, rate="200mbit", nodes=2, inter_rate="40mbit", id=prefix) as c:
        expect_rate("host 0 -> host 1 (same node)", mbits(c, 0, 1, 4), 200)
        expect_rate("host 1 -> host 0 (same node)", mbits(c, 1, 0, 4), 200)
        expect_rate("host 0 -> host 2 (across nodes)", mbits(c, 0, 2, 1.5), 40)
        c.set_rate(3, "20mbit")
        expect_rate("host 3 -> host 2 throttled", mbits(c, 3, 2, 0.8), 20)
        c.cut(1)
        blocked = c.popen(0, [sys.executable, "-c", PROBE, "send", c.addr(1), "0.1"])
        time.sleep(1.0)
        if blocked.poll() is not None:
            fail("a connection to a cut host finished (exit %s)" % blocked.returncode)
        blocked.kill()  # it would connect to the next probe's receiver once the link is back
        blocked.wait()
        c.restore(1)
        expect_rate("host 0 -> host 1 restored", mbits(c, 0, 1, 4), 200)
        sleeper = c.popen(2, ["sleep", "600"])
        procs = list(c.procs)
    expect_gone(prefix, procs + [sleeper])

    prefix = "dtce%d" % pid
    try:
        with netns_cluster.Cluster(hosts=2, id=prefix) as c:
            sleeper = c.popen(1, ["sleep", "600"])
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    expect_gone(prefix, [sleeper])

    # The command-line tool: SIGTERM mid-run tears everything down.
    tool = subprocess.Popen([sys.executable, os.path.join(HERE, "netns_cluster.py"), "--hosts=3", "--", "sleep", "600"])
    prefix = "dtc%d-" % tool.pid
    for _ in range(300):  # up to 30 s (was 10 s), for a loaded machine
        if len(netns_cluster.leftovers(prefix)) == 4:
            break
        time.sleep(0.1)
    if len(netns_cluster.leftovers(prefix)) != 4:
        fail("the tool did not make 3 hosts and a switch: %s" % netns_cluster.leftovers(prefix))
    tool.send_signal(signal.SIGTERM)
    rc = tool.wait(timeout=30)
    print("tool after SIGTERM: exit %d" % rc, flush=True)
    expect_gone(prefix)
    out = subprocess.run([sys.executable, os.path.join(HERE, "netns_cluster.py"), "--rate=fast", "--", "true"],
                         stderr=subprocess.PIPE, text=True)
    if out.returncode != 2 or out.stderr.count("\n") != 1 or "rate 'fast'" not in out.stderr:
        fail("--rate=fast: exit %d, %r" % (out.returncode, out.stderr))
    ok = subprocess.run([sys.executable, os.path.join(HERE, "netns_cluster.py"), "--hosts=2", "--",
                         "sh", "-c", "test $DTRAIN_HOST_ADDR = 10.77.0.$(({host} + 1)) && exit $((7 * {host}))"])
    if ok.returncode != 7:
        fail("the tool should exit with host 1's code 7, got %d" % ok.returncode)
    print("%d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
