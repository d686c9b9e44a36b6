"""The GPU bench's two-engine parts, in order on one cluster (bench/vllm/gpu_pair.py):
"70b" (engines a and b: a pull over CUDA IPC) and "peer" (engine a's own pool, then
engine o with vLLM's OffloadingConnector once b has stopped).

Every failure is kept as text in the result and the next step goes on: a peer that
cannot start must not cost the kvdir rows, nor the 70B rows the peer's.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

from bench.vllm import gpu_70b, gpu_peer
from bench.vllm.gpu_70b import PairBench
from bench.vllm.gpu_calls import TURN_TOKENS, prompt
from bench.vllm.gpu_nodes import SHAPES
from bench.vllm.gpu_pair import PairNodes, pair_nodes
from kvdir.local import ClusterError

SHAPE = "70b-20l"
SEED_70B = 2000
SEED_PEER = 3000
WARM_TOKENS = 256


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _warm(pb: PairBench, name: str) -> None:
    pb.gen(name, prompt(2, WARM_TOKENS, pb.vocab))


def _part_70b(pb: PairBench, n: PairNodes, args: argparse.Namespace, out: dict[str, Any]) -> None:
    try:
        n.start_kvdir("b")
        _warm(pb, "b")
        if not args.skip_checks:
            pb.check("ipc_70b", lambda: pb.ipc_check(SEED_70B))
        for rep in range(args.repeats):
            with contextlib.suppress(ClusterError):  # one lost row, not the part
                out["raw_70b"].append(pb.measure(SEED_70B + 10 * (rep + 1)))
    except Exception as e:
        out["errors"]["70b"] = _error(e)
    finally:
        n.stop("b")  # o takes its memory


def _rows(pb: PairBench, name: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    if args.skip_checks:  # the first load compiles and allocates: not a measurement
        gpu_peer.reload(pb, name, SEED_PEER)
    else:
        pb.check(f"reload_{name}", lambda: gpu_peer.reload_check(pb, name, SEED_PEER))
    rows = out["peer_raw"][name]
    for rep in range(args.repeats):  # the same prompts on a and o
        with contextlib.suppress(ClusterError):
            rows.append(gpu_peer.reload(pb, name, SEED_PEER + 10 * (rep + 1)))
            print(f"==> peer {name}: {rows[-1]}", flush=True)


def _part_peer(pb: PairBench, n: PairNodes, args: argparse.Namespace, out: dict[str, Any]) -> None:
    try:
        _rows(pb, "a", args, out)
    except Exception as e:
        out["errors"]["a"] = _error(e)
    try:
        n.start_peer()
        _warm(pb, "o")
        _rows(pb, "o", args, out)
    except Exception as e:
        out["errors"]["o"] = _error(e)
    finally:
        n.stop("o")


def run_two(args: argparse.Namespace, work: str, parts: tuple[str, ...]) -> dict[str, Any]:
    """Run the selected two-engine parts; their rows, checks and errors as data."""
    shape = SHAPES[SHAPE]
    max_len = gpu_70b.TOKENS + 2 * TURN_TOKENS
    out: dict[str, Any] = {
        "shape": shape.describe(),
        "parts": list(parts),
        "errors": {},
        "checks": [],
        "raw_70b": [],
        "peer_raw": {"a": [], "o": []},
        "part_s": {},
    }
    agents = ("a", "b") if "70b" in parts else ("a",)
    t0 = time.monotonic()
    pb: PairBench | None = None
    try:
        with pair_nodes(
            work, shape, max_len, args.pair_pool_slots, args.pair_memory_share, agents
        ) as n:
            pb = PairBench(n)
            n.start_kvdir("a")
            _warm(pb, "a")
            if "70b" in parts:
                _part_70b(pb, n, args, out)
                out["part_s"]["70b"] = time.monotonic() - t0
            if "peer" in parts:
                t1 = time.monotonic()
                _part_peer(pb, n, args, out)
                out["part_s"]["peer"] = time.monotonic() - t1
    except Exception as e:  # the cluster or engine a: nothing of these parts ran
        out["errors"]["cluster"] = _error(e)
    if pb is not None:
        out["checks"] = pb.checks
    out["part_s"]["two_engine_total"] = time.monotonic() - t0
    if out["raw_70b"]:
        out["summary_70b"] = gpu_70b.summarize(out["raw_70b"])
    out["peer_summary"] = {
        k: gpu_peer.summarize(rows) for k, rows in out["peer_raw"].items() if rows
    }
    return out


def markdown(out: dict[str, Any]) -> list[str]:
    errors = out["errors"]
    lines: list[str] = []
    if "cluster" in errors:
        lines += [f"Two-engine cluster failed: `{errors['cluster']}`", ""]
    if "70b" in out["parts"]:
        lines += gpu_70b.markdown(out["shape"], out.get("summary_70b"), errors.get("70b"))
    if "peer" in out["parts"]:
        peer_errors = {k: v for k, v in errors.items() if k in ("a", "o")}
        lines += gpu_peer.markdown(out["shape"], out["peer_summary"], peer_errors)
    return lines


def failed(out: dict[str, Any]) -> list[str]:
    """What fails the run: kvdir's checks, wrong kvdir answers, kvdir parts that did not
    run. The peer's own failures are reported, not counted against kvdir."""
    bad = [c["check"] for c in out["checks"] if not c["ok"] and c["check"] != "reload_o"]
    bad += [f"error:{k}" for k in out["errors"] if k != "o"]
    s70 = out.get("summary_70b")
    if s70 is not None and not s70["correct"]:
        bad.append("70b:wrong_first_token")
    sa = out["peer_summary"].get("a")
    if sa is not None and not sa["correct"]:
        bad.append("peer_a:wrong_first_token")
    return bad
