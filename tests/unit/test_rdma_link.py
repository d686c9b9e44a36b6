"""ConnectRdma's holder side, without pyverbs: checks before any queue pair is made."""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest

from kvdir.agent import rdma_link
from kvdir.transfer.base import PeerUnavailable
from kvdir.transfer.engine import TransferEngine
from kvdir.v1 import agent_pb2 as apb


class Aborted(Exception):
    pass


class FakeContext:
    def abort(self, code: grpc.StatusCode, msg: str) -> None:
        raise Aborted(code, msg)


class FakeRdma:
    def __init__(self) -> None:
        self.accepted: list[dict[str, str]] = []

    def accept(self, params: dict[str, str]) -> dict[str, str]:
        self.accepted.append(params)
        if params.get("qpn") == "bad":
            raise PeerUnavailable("bad rdma connection params")
        return {"qpn": "7", "version": "1"}


def _engine(with_rdma: bool) -> tuple[TransferEngine, FakeRdma]:
    engine = TransferEngine([])
    fake = FakeRdma()
    if with_rdma:
        engine.transports["rdma"] = cast("Any", fake)
    return engine, fake


def _call(engine: TransferEngine, **kw: Any) -> apb.ConnectRdmaResponse:
    req = apb.ConnectRdmaRequest(
        version=kw.get("version", 1),
        node_id="b",
        holder_node_id=kw.get("holder", "a"),
        params=kw.get("params", {"qpn": "3"}),
    )
    ctx = cast("grpc.ServicerContext", FakeContext())
    return rdma_link.serve_connect("a", engine, req, ctx)


def test_a_request_for_another_node_is_refused_before_any_qp() -> None:
    engine, fake = _engine(True)
    with pytest.raises(Aborted, match="not 'z'") as e:
        _call(engine, holder="z")
    assert e.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION and fake.accepted == []


def test_versions_and_missing_rdma_are_refused() -> None:
    engine, _ = _engine(True)
    with pytest.raises(Aborted, match="version 9"):
        _call(engine, version=9)
    without, _ = _engine(False)
    with pytest.raises(Aborted, match="does not offer rdma"):
        _call(without)


def test_accepted_params_come_back_and_bad_params_are_invalid() -> None:
    engine, fake = _engine(True)
    assert dict(_call(engine).params) == {"qpn": "7", "version": "1"}
    assert fake.accepted == [{"qpn": "3"}]
    with pytest.raises(Aborted) as e:
        _call(engine, params={"qpn": "bad"})
    assert e.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
