"""The Echo baseline: an RPC of the same request and response sizes as each Lookup.

The replicas serve `kvdir.v1.Echo` too (`serve --enable-echo`); an Echo twin
per query chain, sized to the byte, shows what gRPC and Python cost without
the directory's work. The lookups phase interleaves them (A B B A).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvdir.v1 import directory_pb2 as pb

FIT_STEPS_MAX = 32


def fit_size(size_of: Callable[[int], int], target: int) -> int:
    """Largest n with size_of(n) <= target (size_of grows by about 1 per n)."""
    n = max(0, target - 8)
    for _ in range(FIT_STEPS_MAX):
        if n > 0 and size_of(n) > target:
            n -= 1
        elif size_of(n + 1) <= target:
            n += 1
        else:
            break
    return n


def echo_like(request_bytes: int, response_bytes: int) -> bytes:
    """A serialized EchoRequest of `request_bytes` asking for a `response_bytes` reply."""
    r = fit_size(lambda n: pb.EchoResponse(payload=b"\0" * n).ByteSize(), response_bytes)
    p = fit_size(
        lambda n: pb.EchoRequest(payload=b"\0" * n, response_bytes=r).ByteSize(), request_bytes
    )
    return pb.EchoRequest(payload=b"x" * p, response_bytes=r).SerializeToString()


def response_bytes(echo_request: bytes) -> int:
    """The size of the EchoResponse that `echo_request` asks for."""
    asked = pb.EchoRequest.FromString(echo_request).response_bytes
    return pb.EchoResponse(payload=b"\0" * asked).ByteSize()


def results(
    target: str, l1: dict[str, Any], e1: dict[str, Any], ln: dict[str, Any], en: dict[str, Any]
) -> dict[str, Any]:
    """The echo section: Echo at 1 and n in flight, and Lookup / Echo ratios."""
    return {
        "replica": target,
        "latency": e1,
        "throughput": en,
        "ratio_p50_1_inflight": l1["p50_ms"] / e1["p50_ms"],
        "ratio_p99_1_inflight": l1["p99_ms"] / e1["p99_ms"],
        "ratio_p50_loaded": ln["p50_ms"] / en["p50_ms"],
        "ratio_throughput": en["per_s"] / ln["per_s"],
        "server_cpu_us_per_call_lookup_minus_echo": ln["server_cpu_us_per_call"]
        - en["server_cpu_us_per_call"],
    }
