"""The KV-event decoder on hostile payloads: a batch or a DecodeError, nothing else."""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings

from bench.fuzz import events, targets
from kvdir.agent.events.decode import Batch, DecodeError, decode_batch

EXAMPLES = 400


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(events.event_payloads())
def test_decode_returns_a_batch_or_a_decode_error(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except DecodeError as e:
        assert e.reason and str(e)
        return
    assert isinstance(batch, Batch)
    assert batch.bad_events >= 0


@pytest.mark.parametrize("depth", events.DEPTHS)
def test_deep_nesting_is_a_decode_error(depth: int) -> None:
    for payload in (events._deep_array(depth), events._deep_map(depth)):
        assert targets.decode(payload).startswith("DecodeError:"), depth


def test_one_bad_event_costs_only_itself() -> None:
    good = ["BlockStored", [1, 2], None, list(range(32)), 16, None]
    payload = msgpack.packb([1.0, [good, ["BlockStored", "not-a-list"], good], 0])
    batch = decode_batch(payload)
    assert (len(batch.events), batch.bad_events) == (2, 1)
