"""The directory benchmark's targets and Markdown, as data (`GOALS`, `SECTIONS`).

`context(data)` does the only arithmetic the report needs (rows of the tables,
labels, derived values); every heading, sentence and column is a template in
`SECTIONS`, rendered by `bench.markdown.render`. A new phase adds its goals to
`GOALS`, its section to `SECTIONS` and, if it needs rows, a line to `context`.
"""

from __future__ import annotations

import json
from typing import Any

from bench import targets as tg
from bench.directory import durability, mirror
from bench.markdown import Code, Pairs, Raw, Section, Table, Text, render, text_and_table
from kvdir import report

GOALS = (
    tg.Goal(
        "lookup_p50",
        "Lookup p50, 500-block chain, 1 in flight",
        ("lookup", "latency", "p50_ms"),
        "<=",
        1.0,
        "ms",
    ),
    tg.Goal(
        "lookup_p99", "Lookup p99, 1 in flight", ("lookup", "latency", "p99_ms"), "info", unit="ms"
    ),
    tg.Goal(
        "lookup_rate",
        "Lookups/s per replica (several clients)",
        ("lookup", "throughput", "per_s"),
        ">=",
        2500,
        "/s",
    ),
    tg.Goal(
        "batch_rate",
        "LookupBatch chains/s per replica",
        ("lookup_batch", "chains_per_s"),
        ">=",
        25_000,
        "/s",
    ),
    tg.Goal(
        "batch_p50",
        "LookupBatch p50 per RPC, 1 in flight",
        ("lookup_batch", "latency", "p50_ms"),
        "info",
        unit="ms",
    ),
    tg.Goal(
        "echo_ratio",
        "Lookup p50 / Echo p50 (same sizes, 1 in flight)",
        ("echo", "ratio_p50_1_inflight"),
        "<=",
        1.5,
        "x",
    ),
    tg.Goal(
        "echo_ratio_loaded",
        "Lookup p50 / Echo p50 under load",
        ("echo", "ratio_p50_loaded"),
        "info",
        unit="x",
    ),
    tg.Goal(
        "publish_rate",
        "Committed publish entries/s (leader, batched)",
        ("publish", "entries_per_s"),
        ">=",
        100_000,
        "/s",
    ),
    tg.Goal(
        "gap_median", "Leader-kill write gap, median", ("failover", "gap_median_s"), "<=", 0.3, "s"
    ),
    tg.Goal("gap_max", "Leader-kill write gap, max", ("failover", "gap_max_s"), "<=", 1.0, "s"),
    tg.Goal("lost", "Acknowledged entries lost", ("verification", "lost_entries"), "<=", 0),
    tg.Goal(
        "compaction_no_election",
        "No election across compaction (terms unchanged)",
        ("compaction", "no_election"),
        "yes",
    ),
    tg.Goal(
        "compaction_capture",
        "Compaction capture on the Raft thread",
        ("compaction", "capture_s"),
        "info",
        unit="s",
    ),
    tg.Goal(
        "memory",
        "Table bytes per entry at --memory-entries",
        ("memory", "table", "bytes_per_entry"),
        "<=",
        200,
        "B",
    ),
    *mirror.GOALS,
    *durability.GOALS,
)

DATA_SHAPE = (
    "A 3-replica LocalCluster (real `kvdir directory serve` processes, Echo enabled) "
    "on this machine, loaded with **{ds[entries]:,}** (block, holder) entries: "
    "{ds[nodes]!s} holder nodes, {ds[chains]:,} chains of {ds[chain_blocks]!s} "
    "blocks ({ds[distinct_blocks]:,} distinct {ds[hash_bytes]!s}-byte hashes); "
    "{ds[multi_holder_chains]:,} chains ({ds[multi_holder_fraction]:.0%}) are "
    "also held by a second node. Publish batches of {ds[publish_batch_entries]!s} "
    "entries, one node per batch. Client and replicas share the machine's "
    "{h[machine][cores]!s} cores."
)
PUBLISH = Pairs(
    (
        ("entries/s", "{p[entries_per_s]}"),
        ("wall time", "{p[wall_s]} s"),
        ("RPCs (failed)", "{p[rpcs]:,} ({p[rpcs_failed]!s})"),
        ("in flight", "{p[inflight]}"),
        ("RPC p50 / p99", "{p[rpc_latency][p50_ms]} / {p[rpc_latency][p99_ms]} ms"),
        ("machine CPU busy", "{p[machine_cpu_busy]:pct}"),
        ("replica CPU s", "{p[replica_cpu_s]:pairs}"),
        ("followers caught up", "{p[followers_caught_up_after_s]} s after"),
    )
)
LOOKUP_TABLE = Table(
    ("", "p50 ms", "p99 ms", "max ms", "rate", "server CPU us/call", "machine CPU", "errors"),
    (
        "{name}",
        "{m[p50_ms]}",
        "{m[p99_ms]}",
        "{m[max_ms]}",
        "{rate} {unit}",
        "{m[server_cpu_us_per_call]}",
        "{m[machine_cpu_busy]:pct}",
        "{errors}",
    ),
    "lookup_rows",
)
LOOKUP_TEXT = (
    "Lookup / Echo p50 ratio: {ec[ratio_p50_1_inflight]}x at 1 in flight, "
    "{ec[ratio_p50_loaded]}x under load; p99 ratio at 1 in flight "
    "{ec[ratio_p99_1_inflight]}x. Echo served {ec[ratio_throughput]}x "
    "the lookup rate. Server CPU per call, lookup minus echo: "
    "{ec[server_cpu_us_per_call_lookup_minus_echo]} us."
)
QUERIES_TEXT = (
    "Queries: {sz[query_chains]:,} distinct full chains drawn at random "
    "({sz[multi_holder_queries]!s} multi-holder), all answered correctly "
    "before timing ({sz[wrong_answers]!s} wrong). Lookup request "
    "{sz[lookup_request_bytes_mean]} B, response "
    "{sz[lookup_response_bytes_distinct]:slash} B (one or two "
    "holders, records included); Echo request {sz[echo_request_bytes_mean]} B, "
    "response {sz[echo_response_bytes_distinct]:slash} B, "
    "one Echo twin per query, same order. 1-in-flight p50 by kind: single holder "
    "{kinds[single_holder][p50_ms]} ms, two holders "
    "{kinds[multi_holder][p50_ms]} ms. Lookup and Echo ran alternately "
    "(A B B A slices of the phase). Client processes send pre-serialized requests "
    "(the packed chain form `directory.client.lookup_request` builds) and parse the "
    "responses."
)
FAILOVER_TABLE = Table(
    (
        "#",
        "killed",
        "new leader",
        "write gap ms",
        "election ms (log)",
        "kill to first ack ms",
        "restart + catch-up s",
        "restart to full Raft mesh s",
    ),
    (
        "{i}",
        "{k[killed]}",
        "{k[new_leader]}",
        "{k[gap_s]:ms}",
        "{k[election_s]:ms}",
        "{k[kill_to_first_ack_s]:ms}",
        "{k[restart_total_s]}",
        "{k[restart_mesh_connected_s]}",
    ),
    "kill_rows",
)
FAILOVER_TEXT = (
    "Gap min / median / max: {fo[gap_min_s]:ms} / {fo[gap_median_s]:ms} / {fo[gap_max_s]:ms} ms. "
    "Gap: {fo[gap_definition]}. Election: from the SIGKILL to the new leader's "
    "'raft role changed' log line. Writer: {fo[writer][client]}; "
    "{fo[writer][acked_writes]:,} writes acknowledged, "
    "{fo[writer][client_errors]!s} gave up after the client's retries. Before "
    "each kill the restarted replica had caught up (applied the leader's commit "
    "index) and every replica reported every Raft peer connected."
)
LOGS_TABLE = Table(
    (
        "replica",
        "role changes",
        "became leader",
        "compactions",
        "CRITICAL lines",
        "of which 'truncating already-applied'",
        "ERROR lines",
    ),
    (
        "{rid}",
        "{x[role_changes]}",
        "{x[became_leader]}",
        "{x[compactions]}",
        "{x[critical]}",
        "{x[truncating_applied]}",
        "{x[errors]}",
    ),
    "log_rows",
)
COMPACTION_TEXT = (
    "Trigger: {cp[trigger]}. The first compaction began "
    "{cp[began_after_fill_s]} s after the logs were long enough (negative: "
    "during the fill). Compactions: {compaction_events}."
)
COMPACTION_ACROSS = (
    "Across the compaction ({cp[across_window]}): terms seen on each replica "
    "over {cp[status_polls]!s} status polls {cp[terms_seen]}, leaders seen "
    "{cp[leaders_seen]}, Raft role changes in the replica logs "
    "{cp[role_changes_across]!s} -> {election_verdict}. "
    "(Terms over the whole phase, fill and wait included: "
    "{cp[terms_seen_whole_phase]}; see Elections.) "
    "During the compaction ({cp[during_window]}): "
    "{cp[writes_during]!s} writes, slowest "
    "{cp[write_latency_max_ms_during]} ms; slowest probe lookup per "
    "replica (ms) {probes}. Raft tick gaps over half the election timeout "
    "across it ('raft thread stalled' lines), longest per replica: {stalls}."
)
ELECTIONS_TEXT = (
    "{el[total]!s} leader elections in the replica logs: {el[after_kill]!s} after a "
    "leader SIGKILL, {el[after_restart]!s} while a killed replica rejoined, "
    "{el[unexplained]!s} with no kill or restart just before."
)
VERIFY_TEXT = (
    "{v[method]}. Acknowledged entries: {v[acknowledged_entries]:,}; lost (max "
    "over replicas): **{v[lost_entries]!s}**. Entries per replica at the end: "
    "{replica_entries} (expected at least {v[expected_entries_min]:,})."
)
TABLE_MEMORY = (
    "Table alone, built in a fresh process through `Table.apply(Publish)` with the "
    "same data shape: **{t[bytes_per_entry]:.1f} bytes per entry** at "
    "{t[entries]:,} entries (RSS {t[rss_before_bytes]:mib} -> "
    "{t[rss_after_bytes]:mib} MiB; applied at "
    "{t[apply_entries_per_s]} entries/s). Accounted for: "
    "{accounted} bytes/entry; the rest is allocator slack and container over-allocation."
)
HOST_LOAD = (
    "The host may be shared. 'Foreign CPU' is the share of the machine's CPU time "
    "spent outside this benchmark's processes (replicas, client workers, this "
    "process) during the phase; a large share means other workloads competed with "
    "the measurement."
)

SECTIONS = (
    Section("header_md", None, (Raw("header_md"),)),
    Section("targets_md", "Targets", (Raw("targets_md"),)),
    Section("ds", "Data shape", (Text(DATA_SHAPE),)),
    Section("p", "Publish (the load)", (PUBLISH,)),
    Section(
        "lk",
        "Lookup, LookupBatch and the Echo baseline (replica {lk[replica]}, a follower)",
        (LOOKUP_TABLE, Text(LOOKUP_TEXT), Text(QUERIES_TEXT)),
    ),
    Section(
        "fo",
        "Leader kill (SIGKILL) under a continuous writer",
        (FAILOVER_TABLE, Text(FAILOVER_TEXT)),
    ),
    Section("log_rows", "Replica logs", (LOGS_TABLE, Code("critical", "Sample CRITICAL lines:"))),
    Section("cp", "Log compaction", ()),
    Section("cp_failed", None, (Text("Failed: {cp[error]}"),)),
    Section("cp_ok", None, (Text(COMPACTION_TEXT), Text(COMPACTION_ACROSS))),
    Section(
        "el",
        "Elections",
        (
            Text(ELECTIONS_TEXT),
            Table(
                ("UTC", "new leader", "phase", "cause"),
                ("{utc}", "{new_leader}", "{phase}", "{cause}"),
                "election_rows",
            ),
        ),
    ),
    Section("v", "No acknowledged write lost", (Text(VERIFY_TEXT),)),
    Section("memory", "Memory", ()),
    Section("t_measured", None, (Text(TABLE_MEMORY),)),
    Section("t_skipped", None, (Text("Table measurement skipped (--skip-memory)."),)),
    text_and_table(
        "rss_rows",
        None,
        "Replica processes (VmRSS) at the {rm[entries]:,}-entry load:",
        ("replica", "empty MiB", "loaded MiB", "growth B/entry"),
        ("{rid}", "{empty_mib}", "{loaded_mib}", "{growth}"),
    ),
    text_and_table(
        "phase_rows",
        "Host load per phase",
        HOST_LOAD,
        ("phase", "wall s", "machine CPU busy", "foreign CPU", "1-min load avg start / end"),
        ("{phase}", "{wall_s}", "{machine_cpu_busy}", "{foreign_cpu_share}", "{loads}"),
    ),
    mirror.SECTION,
    durability.SECTION,
    Section("settings", "Settings", (Code("settings"),)),
    Section("error", "Error", (Code("error"),)),
)


def _lookup_rows(lk: dict[str, Any], ec: dict[str, Any], lb: dict[str, Any] | None) -> list[Any]:
    rows = [
        ("Lookup, 1 in flight", lk["latency"], "lookups/s"),
        ("Echo, 1 in flight", ec["latency"], "echo/s"),
        (f"Lookup, {lk['throughput']['concurrency']} in flight", lk["throughput"], "lookups/s"),
        (f"Echo, {ec['throughput']['concurrency']} in flight", ec["throughput"], "echo/s"),
    ]
    if lb:  # a phase of its own: absent where it failed
        x, t, o = lb["chains_per_rpc"], lb["throughput"], lb["throughput_omit_records"]
        rows += [
            (f"LookupBatch x{x}, 1 in flight", lb["latency"], "chains/s"),
            (f"LookupBatch x{x}, {t['concurrency']} in flight", t, "chains/s"),
            (f"LookupBatch x{x} omit_records, {o['concurrency']} in flight", o, "chains/s"),
        ]
    return [
        {
            "name": n,
            "m": m,
            "unit": u,
            "rate": m.get("chains_per_s", m["per_s"]),
            "errors": sum(m["errors"].values()),
        }
        for n, m, u in rows
    ]


def _compaction(cp: dict[str, Any]) -> dict[str, Any]:
    if "error" in cp:
        return {"cp_failed": True}
    return {
        "cp_ok": True,
        "compaction_events": "; ".join(
            f"{e['replica']}: {report.fmt(e['entries'])} entries, capture {e['capture_s']} s, "
            f"total {e['total_s']} s"
            for e in cp["events"]
        ),
        "probes": {k: report.fmt(v) for k, v in cp["lookup_latency_max_ms_during"].items()},
        "election_verdict": "no election" if cp["no_election"] else "**an election happened**",
        "stalls": _stall_text(cp.get("raft_stall_longest_across")),
    }


def _stall_text(longest: dict[str, Any] | None) -> str:
    if longest is None:
        return "not recorded"
    return ", ".join(
        f"{rid} none" if x is None else f"{rid} {x['gap_ms']} ms ({x['fdatasync_ms']} ms fdatasync)"
        for rid, x in longest.items()
    )


def _memory(mem: dict[str, Any]) -> dict[str, Any]:
    t, rm = mem.get("table"), mem.get("replicas")
    out: dict[str, Any] = {"memory": bool(mem or rm), "rm": rm}
    if t and not t.get("skipped"):
        acc = t.get("accounted_bytes_per_entry", {})
        out.update(
            t_measured=True, t=t, accounted=", ".join(f"{k} {v:.1f}" for k, v in acc.items())
        )
    elif t:
        out["t_skipped"] = True
    if rm:
        out["rss_rows"] = [
            {
                "rid": k,
                "empty_mib": rm["rss_bytes_empty"].get(k, 0) / 2**20,
                "loaded_mib": v / 2**20,
                "growth": rm["bytes_per_entry"][k],
            }
            for k, v in rm["rss_bytes_loaded"].items()
        ]
    return out


def _phase_row(p: dict[str, Any]) -> dict[str, Any]:
    loads = p.get("loadavg_start", [])[:1] + p.get("loadavg_end", [])[:1]
    return {
        **p,
        "wall_s": p.get("wall_s"),
        "machine_cpu_busy": p.get("machine_cpu_busy"),
        "foreign_cpu_share": p.get("foreign_cpu_share"),
        "loads": " / ".join(str(x) for x in loads),
    }


def _sections(r: dict[str, Any]) -> dict[str, Any]:
    """The per-section context: which sections there are, and their rows."""
    ctx: dict[str, Any] = {"ds": r.get("data_shape"), "p": r.get("publish")}
    if "lookup" in r:
        lk = r["lookup"]
        ctx.update(
            lk=lk,
            ec=r["echo"],
            sz=lk["sizing"],
            kinds=lk["latency"]["by_kind"],
            lookup_rows=_lookup_rows(lk, r["echo"], r.get("lookup_batch")),
        )
    if "failover" in r:
        ctx["fo"] = r["failover"]
        ctx["kill_rows"] = [{"i": i + 1, "k": k} for i, k in enumerate(r["failover"]["kills"])]
    logs = r.get("replica_logs") or {}
    ctx["log_rows"] = [{"rid": rid, "x": x} for rid, x in logs.items()]
    ctx["critical"] = [m for x in logs.values() for m in x["critical_samples"]][:3]
    if "compaction" in r:
        ctx.update(cp=r["compaction"], **_compaction(r["compaction"]))
    if r.get("elections"):
        ctx.update(el=r["elections"], election_rows=r["elections"]["events"])
    if "verification" in r:
        v = r["verification"]
        ctx.update(v=v, replica_entries=str({k: x["entries"] for k, x in v["replicas"].items()}))
    ctx.update(_memory(r.get("memory", {})))
    ctx["phase_rows"] = [_phase_row(p) for p in r.get("phases") or []]
    ctx.update(mirror.context(r))
    ctx.update(durability.context(r))
    return ctx


def context(data: dict[str, Any]) -> dict[str, Any]:
    h, cfg = data["header"], data["config"]
    return {
        "h": h,
        "header_md": report.header_markdown(h),
        "targets_md": report.targets_table([tg.from_dict(t) for t in data["targets"]]),
        **_sections(data["results"]),
        "settings": [json.dumps(cfg, indent=1)] if cfg else [],
        "error": [data["error"]] if data.get("error") else [],
    }


def targets(results: dict[str, Any]) -> list[report.Target]:
    return tg.check_all(GOALS, results)


def markdown(data: dict[str, Any]) -> str:
    return render("# kvdir directory benchmark, {h[started_utc]:.10}", SECTIONS, context(data))
