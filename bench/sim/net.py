"""The simulated network: pysyncobj's transport interface over a seeded message queue.

`SimTransport` is what a replica gets instead of `FencedTransport`
(`_replica.Hooks.transport_class`). A message is pickled on send, exactly as
pysyncobj's TCP connection does (so a receiver never shares an object with
the sender), and handed to the `Network`, which decides its fate from a
random stream of its own link (seed, sender, receiver): lost, delayed,
duplicated (Raft's messages, not forwarded client commands: `NOT_DUPLICATED`),
or let overtake earlier messages of its link. Pieces of a stream (a large entry
in chunks, a snapshot) keep TCP's promises, as pysyncobj relies on them: in
order, once, and a lost piece breaks the connection (`_streamed`). Without those
faults a link behaves like TCP: in order, each message once, and a broken
connection loses whatever it still carried (messages carry the link's
connection epoch).

Links drawn from per-link streams, and delivery ordered by (time, sender,
receiver, link sequence), keep a run independent of the order in which
pysyncobj iterates its sets of nodes (string hashing differs per process),
so a seed replays identically in any process.

A link is up while both replicas run, no partition separates them and each
knows the other (a TCP peer refuses a connection from an address it does not
know). Changes reach pysyncobj through its connected / disconnected callbacks.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Any, ClassVar

from pysyncobj import pickle
from pysyncobj.transport import Transport

Link = tuple[str, str]


@dataclass(frozen=True, slots=True)
class NetFaults:
    """Message faults, per message sent on a link that is up."""

    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    """Chance that a message ignores the link's order (may overtake earlier ones)."""
    delay_min_s: float = 0.0005
    delay_max_s: float = 0.005


@dataclass(order=True, slots=True)
class _InFlight:
    at: float
    src: str
    dst: str
    seq: int
    epoch: int
    data: bytes


NOT_DUPLICATED = frozenset({"apply_command", "apply_command_response"})
"""Message types never duplicated: a follower forwards a client's command to the
leader as one `apply_command`, and the leader appends whatever arrives (no request
id is checked), so a duplicate is a second write. TCP, the only transport
pysyncobj runs on here, never duplicates; Raft's own messages are duplicated."""


def _streamed(message: Any) -> bool:
    """A piece of a stream pysyncobj sends over one TCP connection and reassembles in order:
    a large entry in chunks (`transmission`) or a snapshot (`serialized`). Such a piece is
    never duplicated or reordered, and losing one breaks the connection (as TCP would
    surface it), which makes both ends start the stream over."""
    return (
        isinstance(message, dict)
        and message.get("type") == "append_entries"
        and ("transmission" in message or "serialized" in message)
    )


def _may_duplicate(message: Any) -> bool:
    return not (isinstance(message, dict) and message.get("type") in NOT_DUPLICATED)


class SimTransport(Transport):  # type: ignore[misc]
    """One replica's end of the `Network` (bound by `transport_class`)."""

    network: ClassVar[Network]

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:  # noqa: N803
        super().__init__(syncObj, selfNode, otherNodes)
        self.address: str = selfNode.address
        self.nodes: dict[str, Any] = {n.address: n for n in otherNodes}
        self.connected: set[str] = set()
        self.network.attach(self)

    def addNode(self, node: Any) -> None:  # noqa: N802 (pysyncobj's names)
        self.nodes[node.address] = node
        self.network.dirty = True

    def dropNode(self, node: Any) -> None:  # noqa: N802
        self.nodes.pop(node.address, None)
        self.network.dirty = True

    def send(self, node: Any, message: Any) -> bool:
        return self.network.send(self.address, node.address, message)

    def destroy(self) -> None:
        self.network.detach(self.address)

    def set_connected(self, peer: str, up: bool) -> None:
        node = self.nodes.get(peer)
        if up:
            self.connected.add(peer)
            if node is not None:
                self._onNodeConnected(node)
        else:
            self.connected.discard(peer)
            if node is not None:
                self._onNodeDisconnected(node)

    def deliver(self, src: str, data: bytes) -> bool:
        node = self.nodes.get(src)
        if node is None:
            return False
        self._onMessageReceived(node, pickle.loads(data))
        return True


def transport_class(network: Network) -> type[SimTransport]:
    """A SimTransport subclass bound to `network` (pysyncobj builds the transport itself)."""
    return type("BoundSimTransport", (SimTransport,), {"network": network})


class Network:
    """Links between replicas, partitions, and the messages in flight."""

    def __init__(self, seed: int, faults: NetFaults, clock: Any) -> None:
        self.seed = seed
        self.faults = faults
        self.clock = clock
        self.transports: dict[str, SimTransport] = {}
        self.cut: set[frozenset[str]] = set()
        self.broken: set[frozenset[str]] = set()
        """Connections broken since the last refresh (down for one refresh, then redialled)."""
        self.dirty = True
        self._epoch: dict[frozenset[str], int] = {}
        self._rng: dict[Link, random.Random] = {}
        self._fifo: dict[Link, float] = {}
        self._seq: dict[Link, int] = {}
        self._queue: list[_InFlight] = []
        self.sent = self.lost = self.delivered = self.dropped = 0

    # ------------------------------------------------------------ topology

    def attach(self, t: SimTransport) -> None:
        self.transports[t.address] = t
        self.dirty = True

    def detach(self, address: str) -> None:
        self.transports.pop(address, None)
        self.dirty = True

    def partition(self, groups: list[list[str]]) -> None:
        """Cut every link between different groups (replicas in no group are cut off)."""
        side = {a: i for i, g in enumerate(groups) for a in g}
        everyone = sorted(set(side) | set(self.transports))
        self.cut = {
            frozenset((a, b))
            for i, a in enumerate(everyone)
            for b in everyone[i + 1 :]
            if side.get(a, -1 - i) != side.get(b, -2 - i)
        }
        self.dirty = True

    def heal(self) -> None:
        self.cut = set()
        self.dirty = True

    def _up(self, a: str, b: str) -> bool:
        ta, tb = self.transports.get(a), self.transports.get(b)
        return (
            ta is not None
            and tb is not None
            and frozenset((a, b)) not in self.cut
            and b in ta.nodes
            and a in tb.nodes
        )

    def refresh(self) -> None:
        """Tell each replica which links went up or down since the last refresh."""
        if not self.dirty:
            return
        self.dirty = bool(self.broken)  # a broken connection comes back at the next refresh
        for a in sorted(self.transports):
            t = self.transports[a]
            for b in sorted(set(t.nodes) | t.connected):
                up = self._up(a, b) and frozenset((a, b)) not in self.broken
                if up != (b in t.connected):
                    if not up:
                        pair = frozenset((a, b))
                        self._epoch[pair] = self._epoch.get(pair, 0) + 1
                    t.set_connected(b, up)
        self.broken = set()

    # ------------------------------------------------------------ messages

    def _link_rng(self, link: Link) -> random.Random:
        rng = self._rng.get(link)
        if rng is None:
            rng = self._rng[link] = random.Random(f"{self.seed}/{link[0]}/{link[1]}")
        return rng

    def send(self, src: str, dst: str, message: Any) -> bool:
        t = self.transports.get(src)
        if t is None or dst not in t.connected:
            return False
        self.sent += 1
        f = self.faults
        rng = self._link_rng((src, dst))
        lost, duplicate = rng.random() < f.loss, rng.random() < f.duplicate
        streamed = _streamed(message)
        if lost:
            self.lost += 1
            if streamed:  # a stream cannot lose a piece and go on: the connection breaks
                self.broken.add(frozenset((src, dst)))
                self.dirty = True
            return True
        data = pickle.dumps(message)
        copies = 2 if duplicate and not streamed and _may_duplicate(message) else 1
        now = self.clock.now
        epoch = self._epoch.get(frozenset((src, dst)), 0)
        for _ in range(copies):
            at = now + rng.uniform(f.delay_min_s, f.delay_max_s)
            if rng.random() >= f.reorder or streamed:
                at = max(at, self._fifo.get((src, dst), 0.0))
                self._fifo[(src, dst)] = at
            seq = self._seq.get((src, dst), 0)
            self._seq[(src, dst)] = seq + 1
            heapq.heappush(self._queue, _InFlight(at, src, dst, seq, epoch, data))
        return True

    def due(self, now: float) -> dict[str, list[tuple[str, bytes]]]:
        """Messages whose time has come, per receiver, in delivery order."""
        out: dict[str, list[tuple[str, bytes]]] = {}
        q = self._queue
        while q and q[0].at <= now:
            m = heapq.heappop(q)
            if self._epoch.get(frozenset((m.src, m.dst)), 0) != m.epoch:
                self.dropped += 1  # the connection that carried it broke
                continue
            out.setdefault(m.dst, []).append((m.src, m.data))
        return out

    @property
    def in_flight(self) -> int:
        return len(self._queue)


__all__ = ["NetFaults", "Network", "SimTransport", "transport_class"]
