"""The agent's part of rdma connection set-up: ConnectRdma, both ends.

A reader's rdma channel needs a queue pair on the holder connected to its
own. The reader sends its QP's params in kvdir.v1.Agent/ConnectRdma, naming
itself and the holder it means to reach; the holder refuses a request meant
for another node (a stale address after a restart elsewhere) and otherwise
answers with a QP of its own (`RdmaTransport.accept`). Nothing here imports
pyverbs: the transport is reached through the engine.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from kvdir.core.security import PLAIN, ClientSecurity, current_identity
from kvdir.core.wire import AGENT_WIRE_VERSION
from kvdir.transfer.base import PeerUnavailable, TransferError
from kvdir.transfer.engine import TransferEngine
from kvdir.transfer.rdma_support import Exchange, RdmaErrors, RdmaOptions
from kvdir.v1 import agent_pb2 as apb
from kvdir.v1 import agent_pb2_grpc as apb_grpc

CONNECT_TIMEOUT_S = 5.0
PARAMS_MAX = 32
"""Entries of a ConnectRdma params map (a handful are used)."""


def options(
    node_id: str,
    listen: str,
    device: str,
    port: int,
    gid_index: int,
    errors: RdmaErrors | None = None,
    security: ClientSecurity = PLAIN,
) -> RdmaOptions:
    """Options of this agent's rdma transport, with ConnectRdma as its exchange."""
    exchange = grpc_exchange(node_id, security)
    return RdmaOptions(device, port, gid_index, listen, node_id, exchange, errors)


def grpc_exchange(self_node: str, security: ClientSecurity = PLAIN) -> Exchange:
    def exchange(descriptor: dict[str, str], params: dict[str, str]) -> dict[str, str]:
        endpoint = descriptor.get("endpoint", "")
        if not endpoint:
            raise PeerUnavailable("the peer's rdma descriptor names no agent endpoint")
        req = apb.ConnectRdmaRequest(
            version=AGENT_WIRE_VERSION,
            node_id=self_node,
            holder_node_id=descriptor.get("node_id", ""),
            params=params,
        )
        with security.channel(endpoint) as ch:
            try:
                resp = apb_grpc.AgentStub(ch).ConnectRdma(req, timeout=CONNECT_TIMEOUT_S)
            except grpc.RpcError as e:
                raise PeerUnavailable(
                    f"ConnectRdma to {endpoint} failed: {e.code().name} {e.details()}"
                ) from e
        return dict(resp.params)

    return exchange


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
    context.abort(code, msg)
    raise AssertionError("unreachable")  # context.abort raises


def serve_connect(
    node_id: str,
    engine: TransferEngine,
    request: apb.ConnectRdmaRequest,
    context: grpc.ServicerContext,
) -> apb.ConnectRdmaResponse:
    """Holder side of ConnectRdma."""
    if request.version != AGENT_WIRE_VERSION:
        _abort(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            f"ConnectRdma version {request.version} is not supported "
            f"(this is {AGENT_WIRE_VERSION})",
        )
    if request.holder_node_id != node_id:
        _abort(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this is {node_id!r}, not {request.holder_node_id!r}",
        )
    caller = current_identity()
    if caller is not None and request.node_id != caller:
        _abort(
            context,
            grpc.StatusCode.PERMISSION_DENIED,
            f"caller {caller!r} may not connect a queue pair as {request.node_id!r}",
        )
    if not request.node_id or len(request.params) > PARAMS_MAX:
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a reader node_id and params are needed")
    transport = engine.transports.get("rdma")
    accept = getattr(transport, "accept", None)
    if accept is None:
        _abort(context, grpc.StatusCode.FAILED_PRECONDITION, "this agent does not offer rdma")
    try:
        params: dict[str, str] = accept(dict(request.params))
    except TransferError as e:
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except Exception as e:  # a verbs failure (out of QPs, ...) must not take the agent down
        _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot create a queue pair: {e}")
    return apb.ConnectRdmaResponse(params=params)
