"""The client side of a chaos run: agents publishing, readers looking up, all recorded.

Run as processes inside the run's client namespace::

    python -m bench.chaos.workload agents  --addresses A,B,C --agents 4 --out F
    python -m bench.chaos.workload readers --addresses A,B,C --replica r1=A ... --out F
    python -m bench.chaos.workload crash-agent --addresses A,B,C --node crash-1 --out F

Every operation is recorded (`bench.chaos.history.Op`) with its invoke and
completion time and an outcome. Writes are classified strictly: *fail* only
when every attempt was refused or answered ``kvdir-outcome: not-applied``;
an attempt that may have reached Raft (a broken connection, a deadline, an
unknown outcome) makes the write *unknown* unless a retry is acknowledged
(every directory write is idempotent). The client library's own
classification is not used: a gRPC UNAVAILABLE from a connection torn while
the request was in flight carries no outcome and may have committed.

Keys: agent ``a`` owns blocks ``a<a>k<k>``, each with one (node, GPU) record
at a fixed address whose length and rkey are functions of the generation, so
a reader can tell a record that does not belong to the generation it names.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from bench.chaos import mirror_reader
from bench.chaos.history import Event, Op, Outcome, Recorder
from kvdir.core.client import _metadata, namespace, records
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

SPACE = namespace("chaos/model", 16, "bf16", "paged")
LIVE_LEASE_MS = 600_000
"""Workload agents must not expire during a run (a crash agent's lease is short)."""
HEARTBEAT_S = 5.0
ATTEMPT_S = 1.0
"""One attempt's gRPC deadline: a stopped replica must not hold an operation."""
WRITE_DEADLINE_S = 10.0
READ_DEADLINE_S = 5.0
LOCAL_READ_DEADLINE_S = 1.0
BACKOFF_S = (0.01, 0.05)
READ_BATCH = 4
RUN_SECONDS_MAX = 3600.0


def block_hash(owner: int, k: int) -> bytes:
    return ((owner + 1) << 32 | k).to_bytes(8, "big")


def key_name(owner: int, k: int) -> str:
    return f"a{owner}k{k}"


def record_of(owner: int, k: int, gen: int) -> tuple[int, int, int]:
    """(address, length, rkey) of key (owner, k) at generation `gen`."""
    address = 0x10_0000_0000 + ((owner << 16) | k) * 0x10000
    return address, 4096 + gen % 4096, (gen * 2654435761 + k) & 0xFFFFFFFF


def owner_node(owner: int) -> str:
    return f"agent-{owner}" if owner < 1000 else f"crash-{owner - 1000}"


class Caller:
    """Bounded attempts against the replicas with strict outcome classification."""

    def __init__(self, addresses: Sequence[str], rng: random.Random) -> None:
        self.addresses = list(addresses)
        self.rng = rng
        self.channels = {a: grpc.insecure_channel(a) for a in self.addresses}
        self.stubs = {a: pb_grpc.PrefixDirectoryStub(c) for a, c in self.channels.items()}
        self.preferred = rng.randrange(len(self.addresses))
        self.retried_maybe = False

    def close(self) -> None:
        for c in self.channels.values():
            c.close()

    def call(
        self, method: str, req: Any, deadline_s: float, pinned: str | None = None
    ) -> tuple[Outcome, Any, float, str]:
        """(outcome, response or None, start of the last attempt, last error).

        `self.retried_maybe` tells afterwards whether an attempt before the last
        may have taken effect: then an acknowledged response describes a
        re-application (a retried remove reports 0 removed), not the effect.
        """
        deadline = time.monotonic() + deadline_s
        maybe = False
        self.retried_maybe = False
        last_start = time.monotonic()
        err = ""
        while True:
            now = time.monotonic()
            if now >= deadline:
                return ("unknown" if maybe else "fail"), None, last_start, err
            target = pinned or self.addresses[self.preferred]
            last_start = now
            try:
                resp = getattr(self.stubs[target], method)(
                    req, timeout=min(ATTEMPT_S, deadline - now)
                )
                self.retried_maybe = maybe
                return "ok", resp, last_start, ""
            except grpc.RpcError as e:
                code, md = e.code(), _metadata(e)
                err = f"{code.name}: {e.details()}"
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    reason = md.get("kvdir-reason", "")
                    return ("unknown" if maybe else "fail"), None, last_start, f"rejected:{reason}"
                definite = code == grpc.StatusCode.RESOURCE_EXHAUSTED or (
                    code == grpc.StatusCode.UNAVAILABLE and md.get("kvdir-outcome") == "not-applied"
                )
                maybe = maybe or not definite
                if pinned is None:
                    hint = md.get("kvdir-leader", "")
                    if hint in self.stubs:
                        self.preferred = self.addresses.index(hint)
                    else:
                        self.preferred = (self.preferred + 1) % len(self.addresses)
            pause = self.rng.uniform(*BACKOFF_S)
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))


def decode_match(owner: int, k: int, matches: Sequence[pb.NodeMatch]) -> tuple[int | None, str]:
    """The generation a lookup shows for key (owner, k), and what is wrong with it ("" if fine)."""
    node = owner_node(owner)
    value: int | None = None
    bad = ""
    for m in matches:
        if m.node_id != node:
            bad = f"foreign holder {m.node_id}"
            continue
        rec = records(m)
        if m.prefix_blocks != 1 or not rec.generations:
            bad = f"prefix of {m.prefix_blocks} blocks"
            continue
        gen = rec.generations[0]
        want = record_of(owner, k, gen)
        got = (rec.addresses[0], rec.lengths[0], rec.rkeys[0])
        if got != want:
            bad = f"record {got} is not generation {gen}'s {want}"
        value = gen
    return value, bad


@dataclass
class Stop:
    event: threading.Event
    deadline: float

    def __call__(self) -> bool:
        return self.event.is_set() or time.monotonic() >= self.deadline


def publish_req(owner: int, k: int, incarnation: int, gen: int) -> pb.PublishRequest:
    addr, length, rkey = record_of(owner, k, gen)
    return pb.PublishRequest(
        node_id=owner_node(owner),
        incarnation=incarnation,
        namespace=SPACE,
        tier=pb.TIER_GPU,
        block_hashes=[block_hash(owner, k)],
        addresses=[addr],
        lengths=[length],
        rkeys=[rkey],
        generations=[gen],
    )


def remove_req(owner: int, k: int, incarnation: int, gen: int) -> pb.RemoveRequest:
    return pb.RemoveRequest(
        node_id=owner_node(owner),
        incarnation=incarnation,
        namespace=SPACE,
        tier=pb.TIER_GPU,
        block_hashes=[block_hash(owner, k)],
        generations=[gen],
    )


def register(c: Caller, owner: int, incarnation: int, lease_ms: int, stop: Stop) -> bool:
    req = pb.RegisterNodeRequest(
        node_id=owner_node(owner),
        host=f"host-{owner}",
        agent_endpoint=f"10.77.1.{owner % 250}:9000",
        transports=["tcp"],
        incarnation=incarnation,
        lease_ms=lease_ms,
    )
    while not stop():
        if c.call("RegisterNode", req, WRITE_DEADLINE_S)[0] == "ok":
            return True
    return False


def write_op(
    c: Caller, rec: Recorder, process: str, kind: str, owner: int, k: int, inc: int, gen: int
) -> Outcome:
    if kind == "publish":
        t0 = time.monotonic()
        out, resp, last, err = c.call("Publish", publish_req(owner, k, inc, gen), WRITE_DEADLINE_S)
        result = None if resp is None else int(resp.applied == 1)
    else:
        t0 = time.monotonic()
        out, resp, last, err = c.call("Remove", remove_req(owner, k, inc, gen), WRITE_DEADLINE_S)
        result = None if resp is None else int(resp.removed)
    t1 = time.monotonic()
    if c.retried_maybe:
        result = None  # the response is the retry's, not the effect's (see Caller.call)
    rec(
        Op(
            process,
            kind,  # type: ignore[arg-type]
            key_name(owner, k),
            t0,
            t1,
            out,
            value=gen,
            result=result,
            last_attempt=last,
        )
    )
    if err.startswith("rejected:"):
        rec(Event("unexpected-rejection", t1, {"process": process, "error": err}))
    return out


def agent_loop(
    addresses: Sequence[str], owner: int, keys: int, pace_s: float, rec: Recorder, stop: Stop
) -> None:
    rng = random.Random(owner * 7919)
    c = Caller(addresses, rng)
    process = owner_node(owner)
    try:
        if not register(c, owner, 1, LIVE_LEASE_MS, stop):
            return
        gen = 0
        present = [False] * keys
        current = [0] * keys
        next_beat = time.monotonic() + HEARTBEAT_S
        while not stop():
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_S
                beat = pb.HeartbeatRequest(node_id=process, incarnation=1)
                _, _, _, err = c.call("Heartbeat", beat, WRITE_DEADLINE_S)
                if err.startswith("rejected:"):
                    rec(Event("unexpected-rejection", time.monotonic(), {"process": process}))
            k = rng.randrange(keys)
            if present[k] and rng.random() < 0.15:
                out = write_op(c, rec, process, "remove", owner, k, 1, current[k])
                if out == "ok":
                    present[k] = False
            else:
                gen += 1
                out = write_op(c, rec, process, "publish", owner, k, 1, gen)
                current[k] = gen
                present[k] = present[k] or out != "fail"
            time.sleep(pace_s)
    finally:
        c.close()


def read_keys(
    c: Caller,
    rec: Recorder,
    process: str,
    picks: Sequence[tuple[int, int]],
    mode: str,
    pinned: str | None,
) -> None:
    lookups = [pb.LookupRequest(namespace=SPACE, block_hashes=[block_hash(o, k)]) for o, k in picks]
    req = pb.LookupBatchRequest(lookups=lookups, linearizable=mode == "lin")
    deadline = READ_DEADLINE_S if mode == "lin" else LOCAL_READ_DEADLINE_S
    t0 = time.monotonic()
    out, resp, last, _ = c.call("LookupBatch", req, deadline, pinned=pinned)
    t1 = time.monotonic()
    for i, (o, k) in enumerate(picks):
        if out != "ok":
            # A failed read observed nothing; reads have no effect either way.
            rec(Op(process, "read", key_name(o, k), t0, t1, "fail", mode=mode, last_attempt=last))  # type: ignore[arg-type]
            continue
        value, bad = decode_match(o, k, resp.results[i].matches)
        rec(
            Op(
                process,
                "read",
                key_name(o, k),
                t0,
                t1,
                "ok",
                value=value,
                mode=mode,  # type: ignore[arg-type]
                replica=resp.read.replica_id,
                applied_index=resp.read.applied_index,
                role=resp.read.role,
                last_attempt=last,
                bad_record=bad,
            )
        )


def reader_loop(
    addresses: Sequence[str],
    process: str,
    agents: int,
    keys: int,
    mode: str,
    pinned: str | None,
    pace_s: float,
    rec: Recorder,
    stop: Stop,
    seed: int,
) -> None:
    rng = random.Random(seed)
    c = Caller(addresses, rng)
    try:
        while not stop():
            picks = [(rng.randrange(agents), rng.randrange(keys)) for _ in range(READ_BATCH)]
            picks = list(dict.fromkeys(picks))
            read_keys(c, rec, process, picks, mode, pinned)
            time.sleep(pace_s)
    finally:
        c.close()


def crash_agent(
    addresses: Sequence[str], index: int, blocks: int, lease_ms: int, rec: Recorder, stop: Stop
) -> int:
    """Register with a short lease, publish `blocks` blocks, say "ready", heartbeat until killed."""
    owner = 1000 + index
    process = owner_node(owner)
    c = Caller(addresses, random.Random(owner))
    incarnation = time.time_ns() // 1000
    if not register(c, owner, incarnation, lease_ms, stop):
        return 1
    beat_stop = threading.Event()

    def beat() -> None:
        req = pb.HeartbeatRequest(node_id=process, incarnation=incarnation)
        while not beat_stop.wait(lease_ms / 5000) and not stop():
            c.call("Heartbeat", req, lease_ms / 2000)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    for k in range(blocks):
        while not stop():
            if write_op(c, rec, process, "publish", owner, k, incarnation, 1) == "ok":
                break
    print("ready", flush=True)
    while not stop():
        time.sleep(0.1)
    beat_stop.set()
    return 0


def _mirror_thread(
    a: argparse.Namespace,
    addresses: Sequence[str],
    i: int,
    pace: float,
    rec: Any,
    stop: Stop,
) -> threading.Thread:
    process = f"mirror-{i}"

    def read(m: Any, picks: Sequence[tuple[int, int]]) -> None:
        mirror_reader.read_once(m, rec, process, picks, SPACE, block_hash, key_name, decode_match)

    args = (addresses, process, a.agents, a.keys, READ_BATCH, pace, rec, stop, a.seed + 200 + i)
    return threading.Thread(target=mirror_reader.mirror_loop, args=(*args, read))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.chaos.workload")
    p.add_argument("role", choices=["agents", "readers", "crash-agent"])
    p.add_argument("--addresses", required=True, help="comma-separated gRPC addresses")
    p.add_argument("--out", required=True)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--keys", type=int, default=16)
    p.add_argument("--lin-readers", type=int, default=2)
    p.add_argument("--replica", action="append", default=[], help="ID=ADDR for a local reader")
    p.add_argument("--mirrors", type=int, default=0, help="readers of a client-side mirror")
    p.add_argument("--pace-ms", type=float, default=20.0)
    p.add_argument("--node", type=int, default=0, help="crash agent index")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--lease-ms", type=int, default=1500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=RUN_SECONDS_MAX)
    a = p.parse_args(argv)
    addresses = a.addresses.split(",")
    ev = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ev.set())
    stop = Stop(ev, time.monotonic() + a.max_seconds)
    with open(a.out, "a") as f:
        rec = Recorder(f)
        lock = threading.Lock()

        def locked(r: Any) -> None:
            with lock:
                rec(r)

        if a.role == "crash-agent":
            return crash_agent(addresses, a.node, a.blocks, a.lease_ms, locked, stop)  # type: ignore[arg-type]
        threads = []
        pace = a.pace_ms / 1000
        if a.role == "agents":
            for i in range(a.agents):
                threads.append(
                    threading.Thread(
                        target=agent_loop, args=(addresses, i, a.keys, pace, locked, stop)
                    )
                )
        else:
            for i in range(a.lin_readers):
                args = (addresses, f"lin-{i}", a.agents, a.keys, "lin", None, pace)
                threads.append(
                    threading.Thread(target=reader_loop, args=(*args, locked, stop, a.seed + i))
                )
            for j, spec in enumerate(a.replica):
                rid, _, addr = spec.partition("=")
                args = (addresses, f"local-{rid}", a.agents, a.keys, "local", addr, pace)
                threads.append(
                    threading.Thread(
                        target=reader_loop, args=(*args, locked, stop, a.seed + 100 + j)
                    )
                )
        if a.role == "readers":
            threads += [
                _mirror_thread(a, addresses, i, pace, locked, stop) for i in range(a.mirrors)
            ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
