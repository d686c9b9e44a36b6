"""Hostile input against real daemons: every case refused clearly, nothing lost.

The harness (bench/fuzz/harness.py) checks after every target that all four
processes still serve and that the kept blocks are byte-for-byte as seeded on
every replica and in the agent. A crash is an INTERNAL/UNKNOWN status (an
unhandled exception), wrong bytes served, or a tcp read outside the grant.
"""

from __future__ import annotations

import pytest

from bench.fuzz import run, targets
from bench.fuzz.harness import Harness
from bench.fuzz.targets import Tally
from tests.fuzz.conftest import CASES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _no_crashes(tally: Tally, seed: int) -> None:
    assert tally.crash_count == 0, (
        f"seed {seed} (KVDIR_FUZZ_SEED={seed} repeats it): {tally.crashes}"
    )


def test_grpc_handlers_refuse_hostile_requests_and_keep_serving(
    harness: Harness, seed: int
) -> None:
    tally = Tally()
    run.fuzz_grpc(harness, tally, CASES, seed)
    run.fuzz_oversized(harness, tally)
    _no_crashes(tally, seed)
    methods = [t for t in tally.cases if not t.startswith("oversized.")]
    assert len(methods) == 20  # 11 directory (Watch, GetShardMap included) + 3 agent + 6 engine
    assert all(tally.cases[m] == CASES for m in methods)
    for target in ("oversized.Publish", "oversized.Handshake", "oversized.Notify"):
        assert tally.outcomes[target] == {"RESOURCE_EXHAUSTED": 1}, tally.outcomes[target]
    refusals = {k for c in tally.outcomes.values() for k in c}
    assert not any(k.endswith("-without-message") for k in refusals), refusals
    print(f"\n{tally.total} gRPC cases, seed {seed}")


def test_garbage_is_invalid_argument_not_internal(harness: Harness) -> None:
    """gRPC's own answer to an unparsable request is INTERNAL; ours says what is wrong."""
    import grpc

    with grpc.insecure_channel(harness.cluster.grpc_addresses[0]) as ch:
        call = ch.unary_unary("/kvdir.v1.PrefixDirectory/Publish", None, None)
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request is not a valid Publish request" in (e.value.details() or "")


def test_tcp_peer_protocol_survives_garbage_and_hostile_reads(harness: Harness, seed: int) -> None:
    tally = Tally()
    run.fuzz_tcp(harness, tally, CASES * 2, seed)
    _no_crashes(tally, seed)
    assert tally.cases["tcp.raw"] == tally.cases["tcp.read"] == CASES * 2


def test_a_peer_reads_exactly_its_grant_over_tcp(harness: Harness) -> None:
    g, kept = harness.grant, harness.kept
    assert g is not None and kept is not None
    ep, end = harness.tcp_endpoint, g.address + g.length
    slot = (kept.records.addresses[0], g.rkey, kept.records.lengths[0])
    assert targets.tcp_read(ep, g, [slot]) == "ok"
    assert targets.tcp_read(ep, g, [(g.address, g.rkey, g.length)]) == "ok"  # the whole grant
    for outside in (
        [(end - 8, g.rkey, 9)],  # one byte past the end
        [(g.address - 1, g.rkey, 2)],  # one byte before the start
        [(slot[0], g.rkey ^ 1, 64)],  # another key
        [(slot[0], g.rkey, 0)],  # nothing
        [slot, (end, g.rkey, 1)],  # one bad segment spoils the request
        [(2**64 - 8, g.rkey, 16)],  # wraps around
    ):
        assert targets.tcp_read(ep, g, outside) == "denied", outside
    over_cap = [(g.address, g.rkey, g.length)] * 1024
    assert targets.tcp_read(ep, g, over_cap) == "bad-request"
    harness.check_intact("explicit tcp reads")


def test_the_tally_counts_server_failures_as_crashes() -> None:
    t = Tally()
    for outcome in ("OK", "INVALID_ARGUMENT", "INTERNAL", "UNKNOWN", "wrong-bytes", "denied"):
        t.record("x", outcome, b"case")
    assert (t.total, t.crash_count, len(t.crashes)) == (6, 3, 3)
