"""The namespaced network of a chaos run: reachability, partitions, heal, teardown."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.chaos import netns
from tests.tools import needs

pytestmark = pytest.mark.integration

WHY = netns.available()

ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7999)); s.listen(8); print("up", flush=True)
s.settimeout(60)
while True:
    c, _ = s.accept(); c.sendall(b"hi"); c.close()
"""

CONNECT = """
import socket, sys
s = socket.socket(); s.settimeout(float(sys.argv[2]))
try:
    s.connect((sys.argv[1], 7999)); print(s.recv(2).decode())
except OSError as e:
    print("no:", type(e).__name__)
"""


def names() -> str:
    return subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False
    ).stdout


def reach(net: netns.Network, src: str, dst: str, timeout_s: float = 0.5) -> bool:
    p = subprocess.run(
        [*net.exec_prefix(src), sys.executable, "-c", CONNECT, net.addresses[dst], str(timeout_s)],
        capture_output=True,
        check=False,
        text=True,
        timeout=30,
    )
    return p.stdout.strip() == "hi"


@needs(not WHY, WHY or "")
@pytest.mark.timeout(120)
def test_partition_drops_only_the_cut_links_and_heal_restores_them() -> None:
    net = netns.Network(["r1", "r2", "r3", "client"])
    net.up()
    servers = []
    try:
        for m in ("r1", "r2", "r3"):
            p = subprocess.Popen(
                [*net.exec_prefix(m), sys.executable, "-c", ECHO_SERVER, net.addresses[m]],
                stdout=subprocess.PIPE,
            )
            servers.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == b"up"
        assert all(reach(net, "client", m) for m in ("r1", "r2", "r3"))
        assert reach(net, "r1", "r2") and reach(net, "r2", "r1")

        net.partition(["r1"], ["r2", "r3"])
        assert not reach(net, "r1", "r2") and not reach(net, "r2", "r1")
        assert not reach(net, "r3", "r1")
        assert reach(net, "r2", "r3")  # the majority still talks
        assert reach(net, "client", "r1")  # and clients still reach the cut-off one

        net.heal()
        assert reach(net, "r1", "r2") and reach(net, "r3", "r1")

        # A process that did not make the partition (the run's recovery path) heals it too.
        net.partition(["r2"], ["r1", "r3"])
        assert not reach(net, "r1", "r2")
        other = netns.Network(list(net.members), prefix=net.prefix)
        other.addresses = dict(net.addresses)
        other.heal(everywhere=True)
        assert reach(net, "r1", "r2") and reach(net, "r2", "r3")
    finally:
        for p in servers:
            p.kill()
            p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()
        net.down()
    assert net.prefix not in names()


@needs(not WHY, WHY or "")
def test_a_failed_setup_leaves_no_namespace_behind() -> None:
    net = netns.Network(["r1", "r1"])  # the second r1 namespace cannot be created
    with pytest.raises(netns.NetError):
        net.up()
    assert net.prefix not in names()
