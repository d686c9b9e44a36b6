"""The transfer benchmark's targets and Markdown, as data (`goals`, `SECTIONS`).

`context(data)` computes the table rows and labels; every heading, sentence
and column is a template in `SECTIONS`, rendered by `bench.markdown.render`.
"""

from __future__ import annotations

from typing import Any

from bench import targets as tg
from bench.markdown import Code, Raw, Section, Table, Text, render, text_and_table
from bench.transfer.config import (
    FIXED_BUFFER_BYTES,
    MIB,
    SHM_RATIO_GOAL,
    STORED_P99_GOAL_US,
    TCP_RATIO_GOAL,
    VISIBLE_P99_GOAL_MS,
    VISIBLE_TIMEOUT_S,
)
from kvdir import report


def _fetch_goals(i: int, row: dict[str, Any]) -> list[tg.Goal]:
    label = f"{row['bytes'] / MIB:g} MiB in {row['block_tokens']}-token blocks"
    case = f"{row['bytes']}_{row['block_tokens']}"
    return [
        tg.Goal(
            f"tcp_vs_raw_socket_{case}",
            f"tcp fetch / raw socket copy, {label}",
            ("fetch", i, "tcp_vs_raw_socket"),
            ">=",
            TCP_RATIO_GOAL,
            "x",
        ),
        tg.Goal(
            f"shm_vs_memcpy_{case}",
            f"shm fetch / memcpy, {label}",
            ("fetch", i, "shm_vs_memcpy"),
            ">=",
            SHM_RATIO_GOAL,
            "x",
        ),
    ]


FIXED_GOALS = (
    *(
        tg.Goal(
            f"stored_p99_batch_{n}",
            f"stored() p99 on the caller's thread, {n} block{'s' if n > 1 else ''}, back to back",
            ("stored_enqueue", f"stored_batch_{n}", "p99_us"),
            "<=",
            STORED_P99_GOAL_US,
            "us",
        )
        for n in (1, 16)
    ),
    tg.Goal(
        "visible_p99",
        "stored() to visible in the reader's lookup, p99",
        ("visibility", "stored", "reader_lookup", "p99_ms"),
        "<=",
        VISIBLE_P99_GOAL_MS,
        "ms",
    ),
)
OVERHEAD_GOALS = tuple(
    tg.Goal(
        f"fixed_overhead_{t}",
        f"fixed cost of a {t} fetch (one 64 KiB block, median)",
        ("fixed_overhead", t, "median_ms"),
        "info",
        unit="ms",
        info_goal="info",
    )
    for t in ("tcp", "shm")
)


def targets(results: dict[str, Any]) -> list[report.Target]:
    fetch = [g for i, row in enumerate(results.get("fetch", [])) for g in _fetch_goals(i, row)]
    out = tg.check_all([*fetch, *FIXED_GOALS], results)
    timeouts = tg.lookup(results, ("visibility", "stored", "timeouts"))
    if timeouts:
        out.append(
            report.Target("visible_timeouts", "stored() never visible", "0", timeouts, "", False)
        )
    return out + tg.check_all(OVERHEAD_GOALS, results)


ENVIRONMENT = (
    "Load average at start {env_start[loadavg_1m]}, at end {env_end[loadavg_1m]} (1 min); "
    "THP anon `{thp_anon}`, shmem `{thp_shmem}`. GB/s are 10^9 bytes per second; MiB are "
    "2^20 bytes."
)
FETCH_TEXT = (
    "Median and min of {cfg[reps]!s} fetches after one warm-up; "
    "the time is the engine's (`EngineClient.fetch` call to answer: directory lookup, "
    "transfer, header validation, engine RPC); *agent* is the agent's own `seconds`. "
    "Baselines ran interleaved with the fetches, rep by rep. Raw socket: one loopback "
    "TCP stream between two processes (this one `recv_into` a preallocated buffer, a "
    "child `sendall` from a buffer), kernel-default socket buffers. memcpy: memoryview "
    "slice assignment between two preallocated, pre-touched buffers. Every fetch was "
    "checked byte for byte (destination poisoned before it). *first*: the untimed "
    "warm-up fetch (peer handshake, and the first touch of fresh pool pages on both "
    "sides); *reads*: the coalesced reads the transfer issued."
)
FETCH_TABLE = Table(
    (
        "size",
        "block tokens",
        "path",
        "median ms",
        "min ms",
        "GB/s",
        "agent ms",
        "first ms",
        "baseline",
        "baseline ms",
        "baseline GB/s",
        "ratio",
        "reads",
    ),
    (
        "{size}",
        "{tokens}",
        "{kind}",
        "{m[median_ms]}",
        "{m[min_ms]}",
        "{m[gbps_median]}",
        "{agent[median_ms]}",
        "{first}",
        "{base_name}",
        "{base[median_ms]}",
        "{base[gbps_median]}",
        "{ratio:x}",
        "{reads}",
    ),
    "fetch_rows",
)
RAW_TEXT = (
    "For reference, the raw socket copy with fixed socket buffers "
    "({fixed_mib!s} MiB SO_SNDBUF/SO_RCVBUF; the product leaves "
    "them to the kernel's autotuning, the 'default buffers' column):"
)
RAW_TABLE = Table(
    ("size", "default buffers ms", "fixed buffers ms", "fixed buffers GB/s"),
    (
        "{size}",
        "{row[raw_socket][median_ms]}",
        "{row[raw_socket_product_buffers][median_ms]}",
        "{row[raw_socket_product_buffers][gbps_median]}",
    ),
    "raw_rows",
)
OVERHEAD_TEXT = (
    "One {block_kib!s} KiB block, {cfg[overhead_reps]!s} fetches "
    "per transport after 3 warm-ups (peer handshake cached)."
)
STORED_TEXT = (
    "{cfg[stored_calls]:,} calls per batch size and mode, "
    "`time.perf_counter_ns` around each. *Back to back* (the target's row): one "
    "call after another, while the notification thread ships them (it holds the GIL "
    "while it writes the headers and builds the Notify, so it competes with the "
    "caller). *Paced*: a {st[pace_us]} us sleep between calls, so each call "
    "starts cold (caches and branch predictors taken by whatever ran meanwhile; "
    "see how much slower the empty call gets). The same blocks are re-stored each "
    "call. Baseline: an empty function of the same signature, timed the same way."
)
VISIBLE_TEXT = (
    "{vis[trials]!s} trials, one new block each; observer: {vis[observer]}, "
    "polled with a {cfg[poll_gap_ms]} ms sleep between polls (one "
    "poll every {vis[stored][poll_period_ms_mean]} ms on average; polling "
    "back to back loads a small machine enough to slow the path it watches), then "
    "each replica directly. "
    "Baseline, interleaved trial by trial: {vis[baseline]}. Timeouts "
    "({visible_timeout_s}): {vis[stored][timeouts]!s} "
    "(baseline {vis[publish][timeouts]!s})."
)
SECTIONS = (
    Section("header_md", None, (Raw("header_md"), Text(ENVIRONMENT))),
    Section("error", None, (Code("error", "**The run failed:**"),)),
    Section("targets_md", "Targets", (Raw("targets_md"),)),
    Section(
        "fetch_rows",
        "Fetch between two agents",
        (Text(FETCH_TEXT), FETCH_TABLE, Text(RAW_TEXT), RAW_TABLE),
    ),
    text_and_table(
        "overhead_rows",
        "Fixed cost of a fetch",
        OVERHEAD_TEXT,
        ("", "median ms", "p90 ms", "min ms"),
        ("{name}", "{v[median_ms]}", "{v[p90_ms]}", "{v[min_ms]}"),
    ),
    text_and_table(
        "stored_rows",
        "stored() on the caller's thread",
        STORED_TEXT,
        ("call", "blocks", "mode", "p50 us", "p99 us", "p99.9 us", "max us", "dropped"),
        (
            "{name}",
            "{batch}",
            "{mode}",
            "{v[p50_us]}",
            "{v[p99_us]}",
            "{v[p999_us]}",
            "{v[max_us]}",
            "{dropped}",
        ),
    ),
    text_and_table(
        "visible_rows",
        "stored() to visible",
        VISIBLE_TEXT,
        ("", "p50 ms", "p90 ms", "p99 ms", "max ms"),
        ("{name}", "{v[median_ms]}", "{v[p90_ms]}", "{v[p99_ms]}", "{v[max_ms]}"),
    ),
)


def _fetch_rows(fetch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "size": f"{row['bytes'] / MIB:g} MiB",
            "tokens": f"{row['block_tokens']} ({row['blocks']} x {row['block_bytes'] // MIB} MiB)",
            "kind": kind,
            "m": row[kind],
            "agent": row[f"{kind}_agent"],
            "first": row["cold_first_ms"].get(kind),
            "base_name": base.replace("_", " "),
            "base": row[base],
            "ratio": row[ratio],
            "reads": row["segments"][kind],
        }
        for row in fetch
        for kind, base, ratio in (
            ("tcp", "raw_socket", "tcp_vs_raw_socket"),
            ("shm", "memcpy", "shm_vs_memcpy"),
        )
    ]


def _overhead_rows(fo: dict[str, Any]) -> list[dict[str, Any]]:
    names = (
        ("tcp fetch, end to end", "tcp"),
        ("tcp fetch, agent side", "tcp_agent"),
        ("shm fetch, end to end", "shm"),
        ("shm fetch, agent side", "shm_agent"),
        ("baseline: empty engine RPC (Lookup of no blocks)", "engine_rpc"),
        (
            f"baseline: directory Lookup with records ({fo['directory_lookup_replica']})",
            "directory_lookup",
        ),
    )
    return [{"name": name, "v": fo[k]} for name, k in names]


def _stored_rows(st: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "batch": batch,
            "mode": "back to back" if not suffix else "paced",
            "v": st[k],
            "dropped": int(st[k]["dropped_notifications"]),
        }
        for suffix in ("", "_paced")
        for name, prefix in (("stored()", "stored"), ("baseline: empty call", "empty_call"))
        for batch in (1, 16)
        for k in [f"{prefix}_batch_{batch}{suffix}"]
    ]


def _visible_rows(vis: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not (vis and vis.get("stored", {}).get("reader_lookup")):
        return []
    names = (
        ("stored() -> visible in reader B's lookup", vis["stored"]["reader_lookup"]),
        ("stored() -> visible on every replica", vis["stored"]["all_replicas"]),
        ("baseline: Publish -> visible in reader B's lookup", vis["publish"]["reader_lookup"]),
        ("baseline: Publish -> visible on every replica", vis["publish"]["all_replicas"]),
        ("baseline: the Publish RPC alone", vis["publish_rpc"]),
    )
    return [{"name": name, "v": v} for name, v in names if v]


def context(data: dict[str, Any]) -> dict[str, Any]:
    h = data["header"]
    r = data.get("results", {})
    env = h.get("environment", {})
    start = env.get("start", {})
    fo, st, vis = r.get("fixed_overhead"), r.get("stored_enqueue"), r.get("visibility")
    return {
        "header_md": report.header_markdown(h),
        "env_start": start,
        "env_end": env.get("end", {}),
        "thp_anon": start.get("thp_anon", "?"),
        "thp_shmem": start.get("thp_shmem", "?"),
        "error": [data["error"].strip()[-3000:]] if data.get("error") else [],
        "targets_md": report.targets_table([tg.from_dict(t) for t in data.get("targets", [])]),
        "cfg": data.get("config", {}),
        "fetch_rows": _fetch_rows(r.get("fetch", [])),
        "raw_rows": [{"size": f"{x['bytes'] / MIB:g} MiB", "row": x} for x in r.get("fetch", [])],
        "fixed_mib": FIXED_BUFFER_BYTES >> 20,
        "fo": fo,
        "block_kib": fo["block_bytes"] >> 10 if fo else None,
        "overhead_rows": _overhead_rows(fo) if fo else [],
        "st": st,
        "stored_rows": _stored_rows(st) if st else [],
        "vis": vis,
        "visible_rows": _visible_rows(vis),
        "visible_timeout_s": f"{VISIBLE_TIMEOUT_S:g} s",
    }


def markdown(data: dict[str, Any]) -> str:
    return render("# kvdir transfer benchmark", SECTIONS, context(data))
