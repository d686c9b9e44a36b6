"""Network namespaces for a chaos run: one per replica, one for the clients.

Each member namespace gets an ``eth0`` (one end of a veth pair) with an
address in 10.77.0.0/24; the other end sits in a *switch* namespace on a
bridge. Nothing is added to the caller's namespace: every address lives
inside namespaces this module creates, named ``<prefix><member>`` with a
prefix unique to the run (parallel runs never collide). Partitions are
nftables rules inside a member's namespace that drop traffic to and from
chosen peers, so the rest of the network (the clients) still reaches it.

Needs root, iproute2 and nft.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

SUBNET = "10.77.0"
SWITCH = "sw"
_TABLE = "kvdir_chaos"
_CMD_TIMEOUT_S = 20


class NetError(RuntimeError):
    pass


def available() -> str:
    """Why namespaces cannot be used here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2 / nftables)"
    return ""


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(
            list(args), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise NetError(f"{' '.join(args)}: timed out") from e
    if check and p.returncode != 0:
        raise NetError(f"{' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p


def new_prefix() -> str:
    """A run-unique namespace prefix: ``kc`` + this pid + random hex."""
    return f"kc{os.getpid()}{secrets.token_hex(2)}-"


@dataclass
class Network:
    """Members (replica ids and "client") each in its own namespace on one bridge."""

    members: list[str]
    prefix: str = field(default_factory=new_prefix)
    addresses: dict[str, str] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)
    partitioned: set[str] = field(default_factory=set)

    def ns(self, member: str) -> str:
        return f"{self.prefix}{member}"

    def exec_prefix(self, member: str) -> list[str]:
        """Argv prefix that runs a command inside `member`'s namespace."""
        return ["ip", "netns", "exec", self.ns(member)]

    def up(self) -> None:
        """Create the switch and every member; on any failure, remove what was made."""
        try:
            self._add_ns(SWITCH)
            sw = self.ns(SWITCH)
            _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", "br0", "up"])
            for i, m in enumerate(self.members):
                ns = self._add_ns(m)
                port = f"p{i}"
                veth = ["ip", "link", "add", "eth0", "netns", ns, "type", "veth"]
                _run([*veth, "peer", "name", port, "netns", sw])
                _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", sw, "link", "set", port, "up"])
                addr = f"{SUBNET}.{i + 1}"
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
                self.addresses[m] = addr
                # An empty table and chains now, so a partition is one atomic rule batch.
                self._nft(m, f"add table inet {_TABLE}")
                for hook in ("input", "output"):
                    self._nft(
                        m,
                        f"add chain inet {_TABLE} {hook} "
                        f"{{ type filter hook {hook} priority 0 ; policy accept ; }}",
                    )
        except BaseException:
            self.down()
            raise

    def _add_ns(self, member: str) -> str:
        ns = self.ns(member)
        _run(["ip", "netns", "add", ns])
        self.created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        return ns

    def _nft(self, member: str, rule: str) -> None:
        _run([*self.exec_prefix(member), "nft", rule])

    def cut(self, member: str, peers: Iterable[str]) -> None:
        """Drop all traffic between `member` and `peers` (rules in `member`'s namespace)."""
        ips = sorted(self.addresses[p] for p in peers if p != member)
        if not ips:
            return
        s = ", ".join(ips)
        self._nft(member, f"add rule inet {_TABLE} input ip saddr {{ {s} }} drop")
        self._nft(member, f"add rule inet {_TABLE} output ip daddr {{ {s} }} drop")
        self.partitioned.add(member)

    def partition(self, side: Iterable[str], other: Iterable[str]) -> None:
        """Cut every member of `side` off from every member of `other`."""
        others = list(other)
        for m in side:
            self.cut(m, others)

    def heal(self, everywhere: bool = False) -> None:
        """Lift the partitions this object made (`everywhere`: in every member's namespace)."""
        members = self.addresses if everywhere else self.partitioned
        for m in sorted(members):
            for hook in ("input", "output"):
                self._nft(m, f"flush chain inet {_TABLE} {hook}")
        self.partitioned.clear()

    def down(self) -> None:
        """Delete every namespace this network created (veths and rules go with them)."""
        errors = []
        for ns in reversed(self.created):
            p = _run(["ip", "netns", "del", ns], check=False)
            if p.returncode != 0 and "No such file" not in p.stderr:
                errors.append(f"{ns}: {p.stderr.strip()}")
        self.created.clear()
        if errors:
            raise NetError("could not delete namespaces: " + "; ".join(errors))


def leftovers(prefix: str = "kc") -> list[str]:
    """Namespaces named like ours whose creating process is gone (a killed run)."""
    p = _run(["ip", "netns", "list"], check=False)
    out = []
    for line in p.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(prefix) or "-" not in name:
            continue
        digits = name[len(prefix) : name.index("-")][:-4]
        if digits.isdigit() and not os.path.exists(f"/proc/{digits}"):
            out.append(name)
    return out


def remove_leftovers(prefix: str = "kc") -> int:
    names = leftovers(prefix)
    for n in names:
        _run(["ip", "netns", "del", n], check=False)
    return len(names)
