"""Mooncake trace parsing, slicing, turn recovery and the synthetic default."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvdir.replay.trace import (
    Request,
    TraceError,
    compress,
    read_trace,
    recover_turns,
    reusable_blocks,
    synthesize,
    to_jsonl,
)


def _line(ts: float, ids: list[int], inp: int | None = None, out: int = 10) -> str:
    n = inp if inp is not None else len(ids) * 512
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids})


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _req(ids: list[int], inp: int | None = None) -> Request:
    return Request(0, 0.0, inp if inp is not None else len(ids) * 512, 1, tuple(ids))


def test_reads_mooncake_lines_in_seconds_from_the_first(tmp_path: Path) -> None:
    p = _write(tmp_path, [_line(1000, [0, 1]), "", _line(2500, [0, 1, 2], 1100, 7)])
    rs = read_trace(p)
    assert [(r.index, r.arrival_s, r.input_tokens, r.output_tokens) for r in rs] == [
        (0, 0.0, 1024, 10),
        (1, 1.5, 1100, 7),
    ]
    assert rs[1].hash_ids == (0, 1, 2)


def test_limit_and_start_slice_the_trace(tmp_path: Path) -> None:
    p = _write(tmp_path, [_line(t * 1000, [t + 10]) for t in range(10)])
    rs = read_trace(p, limit=3, start_s=4.0)
    assert [r.hash_ids for r in rs] == [(14,), (15,), (16,)]
    assert rs[0].arrival_s == 0.0 and rs[2].arrival_s == 2.0


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        (_line(-1, [1]), "timestamp"),
        (json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}), "hash_ids"),
        (_line(0, [1, -2]), "hash_ids"),
        (_line(0, [1], inp=513), "needs more than"),
        (
            json.dumps({"timestamp": 0, "input_length": 1, "output_length": "x", "hash_ids": [1]}),
            "output_length",
        ),
        (_line(0, list(range(5000))), "blocks"),
    ],
)
def test_bad_lines_name_the_line(tmp_path: Path, line: str, needle: str) -> None:
    p = _write(tmp_path, [_line(0, [1]), line])
    with pytest.raises(TraceError, match=needle) as e:
        read_trace(p)
    assert f"{p}:2" in str(e.value)


def test_timestamps_going_backwards_and_missing_or_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="backwards"):
        read_trace(_write(tmp_path, [_line(5, [1]), _line(4, [2])]))
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(_write(tmp_path, [""]))


def test_turns_follow_whole_chains_not_a_shared_system_prompt() -> None:
    rs = recover_turns(
        [
            _req([0, 1, 2]),  # conversation x, turn 1
            _req([0, 5, 6]),  # conversation y, turn 1 (shares only block 0)
            _req([0, 1, 2, 3, 4]),  # x turn 2: extends x's whole chain
            _req([0, 5, 7], inp=1100),  # y turn 2: y's chain minus a partial last block
            _req([0, 1, 2, 3, 4, 8]),  # x turn 3
            _req([0]),  # a bare system prompt: turn 1
            _req([0, 9]),  # links to no one: one block in common is not a conversation
        ]
    )
    assert [(r.turn, r.parent) for r in rs] == [
        (1, -1),
        (1, -1),
        (2, 0),
        (1, -1),
        (3, 2),
        (1, -1),
        (1, -1),
    ]


def test_partial_last_block_links_the_next_turn() -> None:
    rs = recover_turns([_req([0, 5, 6], inp=1100), _req([0, 5, 7, 8])])
    assert rs[1].turn == 2 and rs[1].parent == 0


def test_reusable_blocks_are_the_leading_blocks_seen_before() -> None:
    rs = [_req([0, 1, 2]), _req([0, 1, 3]), _req([4, 1]), _req([0, 1, 3, 5])]
    assert reusable_blocks(rs) == [0, 2, 0, 3]


def test_compress_divides_arrivals_and_rejects_nonsense() -> None:
    rs = [Request(0, 10.0, 1, 1, (1,))]
    assert compress(rs, 4)[0].arrival_s == 2.5
    with pytest.raises(TraceError):
        compress(rs, 0)


def test_synthetic_trace_is_deterministic_multi_turn_and_round_trips(tmp_path: Path) -> None:
    a, b = synthesize(conversations=30, seed=3), synthesize(conversations=30, seed=3)
    assert a == b
    assert synthesize(conversations=30, seed=4) != a
    assert sum(r.turn == 1 for r in a) == 30
    assert max(r.turn for r in a) >= 3
    assert all(r.arrival_s <= s.arrival_s for r, s in itertools.pairwise(a))
    for r in a:
        assert (len(r.hash_ids) - 1) * 512 < r.input_tokens <= len(r.hash_ids) * 512
        if r.parent >= 0:
            p = a[r.parent]
            assert r.hash_ids[: p.input_tokens // 512] == p.hash_ids[: p.input_tokens // 512]
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(to_jsonl(a)) + "\n")
    back = read_trace(path)
    assert [(r.hash_ids, r.turn, r.input_tokens) for r in back] == [
        (r.hash_ids, r.turn, r.input_tokens) for r in a
    ]


@pytest.mark.parametrize("ids", [[[0, 1], [0, 2, 1]], [[0, 1], [1]], [[0, 0]]])
def test_ids_that_are_not_prefix_chained_are_refused(tmp_path: Path, ids: list[list[int]]) -> None:
    p = _write(tmp_path, [_line(t, chain) for t, chain in enumerate(ids)])
    with pytest.raises(TraceError, match="prefix-chained"):
        read_trace(p)
