"""CPU per request in `kvdir bench gateway`: the proxies', the backends', the load generator's.

The proxies say their own CPU (`process_cpu_seconds_total` on every worker's
port, so a worker's threads and its mirror count); the echo backends and this
process are read from /proc. The machine's busy share over the same phase
shows how much of the host the phase had: the development machine is shared.
"""

from __future__ import annotations

import collections
import math
import os
import urllib.request
from typing import Any

from bench import host
from kvdir import report

METRICS_TIMEOUT_S = 5.0


def metric(port: int, name: str) -> float:
    """The sum of a metric's samples on a gateway's /metrics."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as r:
        text = r.read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


class PhaseCpu:
    """CPU seconds one phase took: the proxy's workers, the backends, this process, the host."""

    def __init__(self, proxy_ports: list[int], backend_pids: list[int]) -> None:
        self.proxy_ports, self.backend_pids = proxy_ports, backend_pids
        self._t0 = self._now()

    def _now(self) -> tuple[float, float, float, tuple[float, float]]:
        proxy = sum(metric(p, "process_cpu_seconds_total") for p in self.proxy_ports)
        backends = sum(host.proc_cpu_s(p) for p in self.backend_pids)
        return proxy, backends, host.proc_cpu_s(os.getpid()), host.machine_cpu()

    def start(self) -> None:
        self._t0 = self._now()

    def stop(self, requests: int) -> dict[str, float]:
        t1 = self._now()
        t0 = self._t0
        return {
            "requests": requests,
            "proxy_cpu_s": t1[0] - t0[0],
            "backends_cpu_s": t1[1] - t0[1],
            "loadgen_cpu_s": t1[2] - t0[2],
            "machine_busy_share": host.busy_share(t0[3], t1[3]),
            "loadavg_1m": (host.load_average() or [math.nan])[0],
        }


def _per_request_us(phases: list[dict[str, Any]], key: str) -> float:
    n = sum(p["requests"] for p in phases)
    return sum(p[key] for p in phases) / n * 1e6 if n else math.nan


def cpu_summary(phases: list[dict[str, Any]], rate: float) -> tuple[str, dict[str, Any]]:
    """Markdown and data: CPU per request of each proxy's phases at `rate`."""
    rows, data, failures = [], {}, []
    for proxy in ("passthrough", "gateway"):
        ps = [p for p in phases if p["proxy"] == proxy and p["rate"] == rate]
        d = {k: _per_request_us(ps, k) for k in ("proxy_cpu_s", "backends_cpu_s", "loadgen_cpu_s")}
        busy = [p["machine_busy_share"] for p in ps]
        loads = [p["loadavg_1m"] for p in ps]
        d["machine_busy_share_mean"] = sum(busy) / len(busy) if busy else math.nan
        d["loadavg_1m_max"] = max(loads, default=math.nan)
        d["failed"] = sum(p.get("failed", 0) for p in ps)
        data[proxy] = d
        kinds = collections.Counter[str]()
        for p in ps:
            kinds.update(p.get("failures", {}))
        failures += [f"- {proxy}: {k} (x{v})" for k, v in kinds.most_common(3)]
        rows.append(
            (
                proxy,
                f"{int(d['failed']):,}",
                f"{d['proxy_cpu_s']:.0f}",
                f"{d['backends_cpu_s']:.0f}",
                f"{d['loadgen_cpu_s']:.0f}",
                f"{d['machine_busy_share_mean']:.2f}",
                f"{d['loadavg_1m_max']:.2f}",
            )
        )
    header = [
        "phases of",
        "failed requests",
        "proxy CPU us/request (all workers)",
        "backends us/request",
        "load generator us/request",
        "machine busy share",
        "load average 1 min (max)",
    ]
    md = f"CPU per request at {rate:g} requests/s (means over the phases):\n\n" + report.table(
        rows, header
    )
    if failures:  # they count as infinitely late in the latencies above
        md += "\n\nFailed requests, most frequent kinds:\n\n" + "\n".join(failures)
    return md, data
