"""The GPU bench's flags, protocols and results without a GPU (bench/vllm/gpu*.py).

The engines here are fakes: vLLM on CUDA cannot run in this tier (the device run's
results are committed under bench/results/). A fake engine keeps a GPU prefix cache
and a connector tier the way vLLM 0.24 reports them (cached tokens: whole blocks,
never the prompt's last token; a reset drops only the GPU cache) and writes kvdir's
load line for the loads its connector would make, so the bench's protocol, parsing,
error handling and tables run as on the H200.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.vllm import gpu, gpu_70b, gpu_args, gpu_two
from bench.vllm.gpu_calls import EngineCalls, parse_loads, parse_timelines
from bench.vllm.gpu_nodes import BLOCK_TOKENS, SHAPES, gpu_engine, last_error
from bench.vllm.gpu_pair import offload_config
from kvdir.agent.engine.vllm.scheduler import _describe, _Stamps, _Timeline
from kvdir.local import ClusterError
from tests.vllm.engines import REPO, EngineError

Block = tuple[str | None, int]


def _blocks(ids: list[int], salt: str | None) -> list[Block]:
    """Chained block keys, as vLLM's: a block's key stands for its whole prefix."""
    out: list[Block] = []
    h = hash(salt)
    for i in range(len(ids) // BLOCK_TOKENS):
        h = hash((h, tuple(ids[BLOCK_TOKENS * i : BLOCK_TOKENS * (i + 1)])))
        out.append((salt, h))
    return out


@dataclass
class FakeEngine:
    """vLLM with a connector: "kvdir" (a shared, directory-like `held`: block -> node)
    or "offload" (a tier of this engine's own). Answers depend on the prompt only."""

    name: str
    log_path: str
    kind: str
    held: dict[Block, str]
    ops: list[str]
    refuse_resets: int = 1
    gpu: set[Block] = field(default_factory=set)
    tier: set[Block] = field(default_factory=set)

    def _tier_has(self, b: Block) -> str | None:
        if self.kind == "offload":
            return self.name if b in self.tier else None
        return self.held.get(b)

    def generate(self, prompts: list[list[int]], **kw: Any) -> dict[str, Any]:
        (ids,) = prompts
        salt, n = kw.get("cache_salt"), int(kw.get("max_tokens", 1))
        self.ops.append(f"{self.name}:gen:{len(ids)}:{'salt' if salt else 'plain'}")
        blocks = _blocks(ids, salt)
        usable = (len(ids) - 1) // BLOCK_TOKENS  # vLLM computes the last token itself
        hit = 0
        while hit < usable and blocks[hit] in self.gpu:
            hit += 1
        first_loaded, owners = hit, []
        while hit < usable and (owner := self._tier_has(blocks[hit])) is not None:
            owners.append(owner)
            hit += 1
        if owners and self.kind == "kvdir":
            self._log_load(first_loaded, hit, owners)
        self.gpu.update(blocks)
        for b in blocks:
            self.tier.add(b)
            self.held.setdefault(b, self.name)
        answer = [(sum(ids) + i) % 1000 for i in range(n)]
        return {"outputs": [{"tokens": answer, "cached": hit * BLOCK_TOKENS}], "seconds": 0.01}

    def _log_load(self, start: int, end: int, owners: list[str]) -> None:
        pool = sum(o == self.name for o in owners)
        peer = len(owners) - pool
        with open(self.log_path, "a") as f:
            f.write(
                f"INFO kvdir load: request r-{start}, blocks {start}..{end}: {pool} from this "
                f"node's pool, {peer} from peers over {'cuda' if peer else 'none'} "
                f"({peer * 1310720} B), 0 recomputed, 4.5 ms (reserve 0.01, fetch 3.0 of "
                f"which agent 2.0 and read 1.5, copy 1.2)\n"
            )

    def metrics(self) -> dict[str, float]:
        return {}

    def reset_prefix_cache(self) -> bool:
        self.ops.append(f"{self.name}:reset")
        if self.refuse_resets > 0:  # vLLM refuses while blocks are still held
            self.refuse_resets -= 1
            return False
        self.gpu.clear()
        return True


@dataclass
class FakePair:
    """gpu_pair.PairNodes' surface, engines faked."""

    base: Path
    peer_error: str | None = None
    shape: Any = SHAPES["70b-20l"]
    engines: dict[str, FakeEngine] = field(default_factory=dict)
    held: dict[Block, str] = field(default_factory=dict)
    ops: list[str] = field(default_factory=list)

    def _start(self, name: str, kind: str) -> FakeEngine:
        self.ops.append(f"{name}:start")
        log = self.base / f"{name}.log"
        log.touch()
        e = FakeEngine(name, str(log), kind, self.held, self.ops)
        self.engines[name] = e
        return e

    def start_kvdir(self, name: str) -> FakeEngine:
        return self._start(name, "kvdir")

    def start_peer(self) -> FakeEngine:
        if self.peer_error:
            raise RuntimeError(self.peer_error)
        return self._start("o", "offload")

    def stop(self, name: str) -> None:
        if self.engines.pop(name, None) is not None:
            self.ops.append(f"{name}:stop")


@dataclass
class Fakes:
    made: list[FakePair] = field(default_factory=list)
    peer_error: str | None = None


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fakes:
    f = Fakes()

    @contextlib.contextmanager
    def pair_nodes(*_: Any) -> Iterator[FakePair]:
        f.made.append(FakePair(tmp_path, peer_error=f.peer_error))
        yield f.made[-1]

    monkeypatch.setattr(gpu_two, "pair_nodes", pair_nodes)
    # What needs an agent or a GPU: the holder waits pass, the bare copy is a number.
    monkeypatch.setattr(gpu_70b.PairBench, "seen_by", lambda *_a, **_k: None)
    monkeypatch.setattr(gpu_70b.PairBench, "pool_holds", lambda *_a, **_k: None)
    monkeypatch.setattr(gpu_70b, "bare_copy_s", lambda nbytes: 0.0005)
    return f


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    gpu_args.add_arguments(p)
    return p.parse_args(list(argv))


# ---------------------------------------------------------------- flags


def test_parts_default_to_all_in_order_and_shape_selects_its_part() -> None:
    assert gpu_args.parts_of(_args()) == ("8b", "70b", "peer")
    assert gpu_args.parts_of(_args("--only", "peer")) == ("peer",)
    assert gpu_args.parts_of(_args("--only", "peer", "8b")) == ("8b", "peer")
    assert gpu_args.parts_of(_args("--shape", "70b-20l")) == ("70b",)
    assert gpu_args.parts_of(_args("--shape", "8b")) == ("8b",)


def test_a_part_not_known_is_one_argparse_line() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bench.vllm.gpu", "--only", "405b"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "invalid choice: '405b'" in r.stderr


def test_help_names_every_part() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bench.vllm.gpu", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    for flag in ("--only", "--pair-memory-share", "--pair-pool-slots", "--shape"):
        assert flag in r.stdout


def test_peer_config_is_vllms_native_offloading() -> None:
    c = offload_config(8 << 30)
    assert c["kv_connector"] == "OffloadingConnector"
    assert c["kv_connector_extra_config"] == {"cpu_bytes_to_use": 8 << 30}
    assert "kv_connector_module_path" not in c  # in vLLM's own registry


# ---------------------------------------------------------------- engine calls


def test_reset_asks_again_until_vllm_lets_go(tmp_path: Path) -> None:
    ops: list[str] = []
    e = FakeEngine("o", str(tmp_path / "o.log"), "offload", {}, ops, refuse_resets=3)
    EngineCalls({"o": e}, 1000).reset_prefix_cache("o")
    assert ops == ["o:reset"] * 4


def test_reset_that_never_happens_is_a_bounded_error(tmp_path: Path) -> None:
    e = FakeEngine("o", str(tmp_path / "o.log"), "offload", {}, [], refuse_resets=10**9)
    with pytest.raises(ClusterError, match="prefix-cache reset"):
        EngineCalls({"o": e}, 1000).reset_prefix_cache("o", timeout_s=0.2)


def test_new_loads_reads_only_lines_appended_since_the_last_call(tmp_path: Path) -> None:
    held: dict[Block, str] = {}
    a = FakeEngine("a", str(tmp_path / "a.log"), "kvdir", held, [])
    b = FakeEngine("b", str(tmp_path / "b.log"), "kvdir", held, [])
    Path(b.log_path).touch()
    calls = EngineCalls({"a": a, "b": b}, 1000)
    p = list(range(10, 10 + 64))
    a.generate([p])
    assert calls.new_loads("b") == []
    b.generate([p + [7] * 16])
    (ld,) = calls.new_loads("b")
    assert (ld["pool"], ld["peer"], ld["transport"], ld["ms"]) == (0, 4, "cuda", 4.5)
    assert calls.new_loads("b") == []
    assert parse_loads("kvdir load: request x, blocks 1..2: garbage") == []


def test_the_timeline_lines_the_scheduler_side_writes_parse() -> None:
    """The bench reads the product's own line: a change of its wording fails here,
    not as an empty table on the H200."""
    t = _Timeline(seen=1.0, calls=2, answered=1.003, allocated=1.0031)
    t.reported, t.reported_steps, t.steps = 1.0095, 1, 3
    t.lookup = _Stamps(ran=1.0004, returned=1.0026)
    quiet = _Timeline(seen=5.0, calls=1, answered=5.002, allocated=5.0025, steps=2)
    text = "\n".join(
        f"INFO kvdir timeline: request {r}: {_describe(x, now)}"
        for r, x, now in (("r1", t, 1.0152), ("r2", quiet, 5.0105))
    )
    one, two = parse_timelines(text)
    assert (one["req"], one["calls"], one["steps"], one["reported_steps"]) == ("r1", 2, 3, 1)
    assert (one["lookup_ms"], one["reported_ms"], one["forward_ms"]) == (3.0, 6.4, 12.1)
    assert one["total_ms"] == 15.2
    assert (one["thread_ms"], one["agent_call_ms"], one["taken_ms"]) == (0.4, 2.2, 0.4)
    assert (two["reported_ms"], two["forward_ms"], two["steps"]) == (None, 8.0, 2)
    assert two["thread_ms"] is None  # a line without the lookup's parts still parses


# ---------------------------------------------------------------- two-engine parts


def test_two_engine_parts_run_in_order_with_every_row_and_check(fakes: Fakes) -> None:
    out = gpu_two.run_two(_args("--repeats", "2"), "unused", ("70b", "peer"))
    (n,) = fakes.made
    assert out["errors"] == {}
    assert [c["check"] for c in out["checks"]] == ["ipc_70b", "reload_a", "reload_o"]
    assert all(c["ok"] for c in out["checks"]), out["checks"]
    starts = [op for op in n.ops if op.endswith((":start", ":stop"))]
    assert starts == ["a:start", "b:start", "b:stop", "o:start", "o:stop"]  # o after b
    s70 = out["summary_70b"]
    assert s70["repeats"] == 2 and s70["correct"] and s70["cached_min"] == 8192
    assert s70["recompute_cached_max"] == 0 and s70["sources"] == ["cuda"]
    for name in ("a", "o"):
        s = out["peer_summary"][name]
        assert s["repeats"] == 2 and s["correct"] and s["cached_min"] == 8192, (name, s)
    # The peer's turn 2 came after a reset and after its salted recompute.
    o_ops = [op for op in n.ops if op.startswith("o:")]
    first = o_ops.index("o:gen:8192:plain")
    assert o_ops[first + 1 : first + 3] == ["o:gen:8256:salt", "o:reset"]
    assert gpu_two.failed(out) == []
    md = "\n".join(gpu_two.markdown(out))
    assert "| 8,192 |" in md and "skipped" in md and "not measured for this shape" in md
    assert "vLLM OffloadingConnector: o's CPU tier" in md and "kvdir: a's own pool" in md


def test_a_peer_that_cannot_start_is_reported_and_costs_no_kvdir_row(fakes: Fakes) -> None:
    fakes.peer_error = "ImportError: undefined symbol in cuda_ops"
    out = gpu_two.run_two(_args("--repeats", "1"), "unused", ("peer",))
    assert out["errors"] == {"o": "RuntimeError: ImportError: undefined symbol in cuda_ops"}
    assert "a" in out["peer_summary"] and "o" not in out["peer_summary"]
    assert "70b" not in out["part_s"] and "peer" in out["part_s"]
    assert gpu_two.failed(out) == []  # the peer's failure is not kvdir's
    md = "\n".join(gpu_two.markdown(out))
    assert "not run" in md and "could not run: `RuntimeError: ImportError" in md


def test_a_wrong_kvdir_answer_fails_the_run_and_a_wrong_peer_answer_is_reported() -> None:
    out: dict[str, Any] = {
        "checks": [{"check": "reload_o", "ok": False}, {"check": "ipc_70b", "ok": True}],
        "errors": {"o": "x"},
        "peer_summary": {"a": {"correct": False}},
        "summary_70b": {"correct": True},
    }
    assert gpu_two.failed(out) == ["peer_a:wrong_first_token"]
    out["errors"]["70b"] = "EngineError: engine b did not start"
    assert "error:70b" in gpu_two.failed(out)


def test_run_writes_one_result_with_the_selected_parts(
    fakes: Fakes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", argparse.Namespace(__version__="0.24.0"))
    out_dir = tmp_path / "results"
    argv = ["--only", "70b", "peer", "--repeats", "1", "--out", str(out_dir)]
    argv += ["--work-dir", str(tmp_path / "work"), "--note", "unit"]
    assert gpu.main(argv) == 0
    (md_path,) = out_dir.glob("vllm-gpu-*.md")
    md = md_path.read_text()
    assert "## 70B shape (20 layers)" in md and "## A peer's connector" in md
    assert "## Turn-2 TTFT (median of repeats)" not in md  # the 8b part did not run
    assert "Seconds per part" in md
    assert "| 70B shape: pulled TTFT over CUDA IPC / local hit at 8192 tokens | <= 1.15 x |" in md
    assert "| kvdir reload TTFT / OffloadingConnector's (70B shape) | info | 1.00 x | info |" in md
    data = json.loads(md_path.with_suffix(".json").read_text())
    assert data["parts"] == ["70b", "peer"] and data["summary"] == []
    assert data["two_engine"]["summary_70b"]["correct"]


# ---------------------------------------------------------------- the driver process

FAKE_VLLM = '''
class LLM:
    """Stands in for vLLM (no CUDA here): refuses the first reset, as vLLM does while a
    finished request's blocks are still held."""

    def __init__(self, **kwargs):
        self.resets = 0

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        assert not reset_running_requests and not reset_connector
        self.resets += 1
        return self.resets > 1
'''


def test_the_gpu_driver_answers_a_reset_over_its_line_protocol(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    e = gpu_engine("o", str(tmp_path), str(tmp_path), SHAPES["70b-20l"], 8320, None, 0.38)
    e.env = {"PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    e.start_timeout_s = 60.0
    try:
        e.launch()
        e.wait_ready()
        assert [e.reset_prefix_cache(), e.reset_prefix_cache()] == [False, True]
        with pytest.raises(EngineError, match="unknown op 'compile'"):
            e.call({"op": "compile"})
    finally:
        e.stop()
    assert e.proc is not None and e.proc.returncode is not None


def test_a_failed_8b_part_is_reported_and_the_others_still_run(
    fakes: Fakes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", argparse.Namespace(__version__="0.24.0"))

    def no_engines(*_: Any) -> dict[str, Any]:
        raise ClusterError("engine n did not start")

    monkeypatch.setattr(gpu, "run_8b", no_engines)
    out_dir = tmp_path / "results"
    argv = ["--only", "8b", "peer", "--repeats", "1", "--out", str(out_dir), "--work-dir"]
    assert gpu.main([*argv, str(tmp_path / "work")]) == 1
    md = next(out_dir.glob("vllm-gpu-*.md")).read_text()
    assert "8B part failed: `ClusterError: engine n did not start`" in md
    assert "## A peer's connector" in md and "Partial" not in md


def test_an_engine_that_died_starting_is_reported_with_its_root_cause(tmp_path: Path) -> None:
    log = tmp_path / "o-engine.log"
    log.write_text(
        "INFO 12-04 starting\n"
        "(EngineCore_DP0 pid=4242) Traceback (most recent call last):\n"
        '(EngineCore_DP0 pid=4242)   File "core.py", line 1, in <module>\n'
        "(EngineCore_DP0 pid=4242) ValueError: Free memory on device cuda:0 (40.1/139.8 GiB)"
        " on startup is less than desired GPU memory utilization (0.38, 53.1 GiB).\n"
        "ERROR 12-04 01:02:03 [core.py:1] EngineCore failed to start.\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    got = last_error(str(log))
    assert got.startswith("ValueError: Free memory on device cuda:0"), got
    assert got.endswith("| RuntimeError: Engine core initialization failed. See root cause above.")
    assert last_error(str(tmp_path / "none.log")).startswith("(no log:")
    log.write_text("INFO all fine\n")
    assert last_error(str(log)) == "(no exception in its log)"
