"""`kvdir fuzz`: hostile input against real daemons, then a report.

For every gRPC method of the directory (PrefixDirectory) and the agent (Agent
over TCP, Engine over its Unix socket), for the agent's tcp peer protocol and
for the KV-event decoder, run `cases` hypothesis examples, then check that
every daemon still serves and that no kept entry was lost or changed
(`Harness.check_intact`). A few oversized messages go to each server too.

Output: cases tried, outcomes by status per target, crashes (must be 0).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc

from bench.fuzz import targets
from bench.fuzz.harness import KEEPER, PLAY_NODE, PLAY_NS, Harness
from bench.fuzz.targets import Tally
from kvdir.core.wire import GRPC_MESSAGE_BYTES_MAX
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import directory_pb2 as pb

"""The directory's receive limit (directory.daemon); the agent keeps gRPC's 4 MiB."""


def _hypothesis_settings(cases: int, seed: int | None) -> Any:
    from hypothesis import HealthCheck, Phase, settings

    return settings(
        max_examples=cases,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # outcomes are tallied, not raised: nothing to shrink
        suppress_health_check=list(HealthCheck),
        derandomize=seed is not None,
    )


def _drive(strategy: Any, cases: int, seed: int | None, one: Callable[[Any], None]) -> float:
    """Run `cases` examples through `one`; the seconds it took."""
    from hypothesis import given
    from hypothesis import seed as hseed

    if cases <= 0:
        return 0.0
    t0 = time.perf_counter()

    run = _hypothesis_settings(cases, seed)(given(strategy)(one))  # type: ignore[no-untyped-call]
    if seed is not None:
        run = hseed(seed)(run)
    run()
    return time.perf_counter() - t0


def _services() -> list[tuple[str, Any, str]]:
    """(target prefix, service descriptor, which endpoint) of every fuzzed service."""
    return [
        ("directory", pb.DESCRIPTOR.services_by_name["PrefixDirectory"], "directory"),
        ("agent", apb.DESCRIPTOR.services_by_name["Agent"], "peers"),
        ("engine", apb.DESCRIPTOR.services_by_name["Engine"], "engine"),
    ]


_PINNED: dict[str, dict[str, Any]] = {
    "directory": {"namespace": PLAY_NS, "node_id": PLAY_NODE, "incarnation": 1},
    "peers": {"version": 1, "holder_node_id": KEEPER},
    "engine": {"namespace": PLAY_NS},
}
"""Values set in half of the structured cases, per endpoint (never the kept ones)."""


def _request_class(method: Any) -> Any:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(method.input_type)


def fuzz_grpc(h: Harness, tally: Tally, cases: int, seed: int | None, only: str = "") -> None:
    from bench.fuzz.cases import request_payloads

    assert h.agent is not None
    every = [_request_class(m) for _, s, _ in _services() for m in s.methods]
    channels = {
        "directory": [grpc.insecure_channel(a) for a in h.cluster.grpc_addresses],
        "peers": [grpc.insecure_channel(h.agent.listen)],
        "engine": [grpc.insecure_channel(f"unix:{h.agent.engine_socket}")],
    }
    try:
        for prefix, service, where in _services():
            for method in service.methods:
                name = f"{prefix}.{method.name}"
                if only and only not in name:
                    continue
                cls = _request_class(method)
                pinned = _PINNED[where]
                path = f"/{service.full_name}/{method.name}"
                others = [c for c in every if c is not cls]

                tally.seconds[name] = _drive(
                    request_payloads(cls, others, pinned),
                    cases,
                    seed,
                    _grpc_case(tally, name, channels[where], path, method.server_streaming),
                )
                h.check_intact(name)
    finally:
        for chans in channels.values():
            for c in chans:
                c.close()


def _grpc_case(
    tally: Tally, name: str, chans: list[grpc.Channel], path: str, streaming: bool
) -> Callable[[tuple[str, bytes]], None]:
    sent = [0]
    call = targets.grpc_stream_raw if streaming else targets.grpc_raw

    def one(case: tuple[str, bytes]) -> None:
        _family, payload = case
        sent[0] += 1  # spread cases over the replicas
        tally.record(name, call(chans[sent[0] % len(chans)], path, payload), payload)

    return one


def fuzz_oversized(h: Harness, tally: Tally) -> None:
    """Messages over each server's receive limit: RESOURCE_EXHAUSTED, nothing else."""
    assert h.agent is not None
    cases = [
        (h.cluster.grpc_addresses[0], "/kvdir.v1.PrefixDirectory/Publish", GRPC_MESSAGE_BYTES_MAX),
        (h.agent.listen, "/kvdir.v1.Agent/Handshake", 4 * 1024 * 1024),
        (f"unix:{h.agent.engine_socket}", "/kvdir.v1.Engine/Notify", 4 * 1024 * 1024),
    ]
    for target, path, limit in cases:
        payload = b"\x0a" + b"\xff" * 3 + b"\x7f" + b"\x00" * (limit + 1024)
        with grpc.insecure_channel(target) as ch:
            tally.record(f"oversized.{path.rsplit('/', 1)[1]}", targets.grpc_raw(ch, path, payload))
    h.check_intact("oversized messages")


def fuzz_tcp(h: Harness, tally: Tally, cases: int, seed: int | None) -> None:
    from hypothesis import strategies as st

    from bench.fuzz.cases import mutated

    grant = h.grant
    assert grant is not None
    end = grant.address + grant.length

    def raw(payload: bytes) -> None:
        tally.record("tcp.raw", targets.tcp_raw(h.tcp_endpoint, payload), payload)

    valid = st.lists(
        st.tuples(st.integers(grant.address, end - 1), st.just(grant.rkey), st.integers(1, 8192)),
        min_size=1,
        max_size=4,
    ).map(targets.read_request)
    tally.seconds["tcp.raw"] = _drive(
        st.one_of(st.binary(max_size=512), mutated(valid)), cases, seed, raw
    )
    h.check_intact("tcp.raw")

    address = st.one_of(
        st.integers(grant.address, end - 1),
        st.sampled_from([0, grant.address - 1, end - 1, end, 2**64 - 1]),
        st.integers(0, 2**64 - 1),
    )
    rkey = st.one_of(st.just(grant.rkey), st.integers(0, 2**32 - 1))
    length = st.one_of(st.integers(1, 8192), st.sampled_from([0, grant.length, 2**32 - 1]))
    segment = st.tuples(address, rkey, length)
    over_cap = st.just([(grant.address, grant.rkey, grant.length)] * 1024)
    reads = st.one_of(st.lists(segment, min_size=1, max_size=4), over_cap)

    def read(segments: list[tuple[int, int, int]]) -> None:
        tally.record("tcp.read", targets.tcp_read(h.tcp_endpoint, grant, segments), repr(segments))

    tally.seconds["tcp.read"] = _drive(reads, cases, seed, read)
    h.check_intact("tcp.read")


def fuzz_decoder(tally: Tally, cases: int, seed: int | None) -> None:
    from bench.fuzz.events import event_payloads

    def one(payload: bytes) -> None:
        tally.record("events.decode", targets.decode(payload), payload)

    tally.seconds["events.decode"] = _drive(event_payloads(), cases, seed, one)


ATHERIS_TIMEOUT_S = 3600


def fuzz_guided(tally: Tally, runs: int, workdir: str) -> None:
    """Each atheris target (bench/fuzz/guided.py) for `runs` libFuzzer executions."""
    import re
    import subprocess

    from bench.fuzz.guided import TARGETS

    for target in TARGETS:
        cmd = [
            sys.executable,
            "-m",
            "bench.fuzz.guided",
            target,
            f"-runs={runs}",
            "-max_len=4096",
            f"-artifact_prefix={workdir}/atheris-{target}-",
        ]
        t0 = time.perf_counter()
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=ATHERIS_TIMEOUT_S, check=False
        )
        tally.seconds[f"atheris.{target}"] = time.perf_counter() - t0
        done = re.search(r"Done (\d+) runs", p.stderr)
        n = int(done.group(1)) if done else 0
        tally.cases[f"atheris.{target}"] += n
        outcome = "no-crash" if p.returncode == 0 and done else "decoder-crash"
        tally.outcomes.setdefault(f"atheris.{target}", Counter())[outcome] += max(n, 1)
        if outcome != "no-crash":
            tally.crashes.append(f"atheris.{target}: rc {p.returncode}: {p.stderr[-600:]}")


def run_all(h: Harness, cases: int, seed: int | None) -> Tally:
    tally = Tally()
    fuzz_grpc(h, tally, cases, seed)
    fuzz_oversized(h, tally)
    fuzz_tcp(h, tally, cases, seed)
    fuzz_decoder(tally, cases * 4, seed)
    return tally


def report(tally: Tally, seconds: float, command: str | None = None) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# kvdir fuzz: {tally.total} cases, {tally.crash_count} crashes",
        "",
        f"- date: {now}; machine: {platform.node()} ({platform.machine()}, "
        f"python {platform.python_version()})",
        f"- command: `{' '.join(['kvdir', *sys.argv[1:]]) if command is None else command}`",
        f"- wall time: {seconds:.0f} s; after every target: daemons serving, kept entries intact",
        "",
        "| target | cases | seconds | outcomes |",
        "| --- | ---: | ---: | --- |",
    ]
    for target in sorted(tally.cases):
        outs = ", ".join(f"{k} {n}" for k, n in tally.outcomes[target].most_common())
        secs = tally.seconds.get(target, 0.0)
        lines.append(f"| {target} | {tally.cases[target]} | {secs:.1f} | {outs} |")
    lines += ["", f"Crashes: {tally.crash_count}"]
    lines += [f"- {c}" for c in tally.crashes]
    return "\n".join(lines) + "\n"


def cmd_fuzz(args: argparse.Namespace) -> int:
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        print(
            "kvdir: error: kvdir fuzz needs hypothesis (pip install -e '.[dev]')", file=sys.stderr
        )
        return 1
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvdir-fuzz-") as base:
        h = Harness(base)
        try:
            h.start()
            tally = run_all(h, args.cases, args.seed)
        finally:
            h.stop()
        if args.atheris_runs:
            fuzz_guided(tally, args.atheris_runs, base)
    text = report(tally, time.monotonic() - t0)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if tally.crash_count == 0 else 1
