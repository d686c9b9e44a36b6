"""The `rdma` backend: one-sided RDMA READs over RC queue pairs, through pyverbs.

The holder's CPU takes no part in a read: its agent registers the pool once
(LOCAL_WRITE | REMOTE_READ, never REMOTE_WRITE) and publishes the memory
region's real rkey and address; a reader posts IBV_WR_RDMA_READs straight from
that memory into its own registered slots.

Connection set-up (one RC QP per (reader, holder) pair):

1. The holder's `descriptor()` names its port: GID, LID, MTU, and where its
   agent answers `ConnectRdma` (the agent's peer service).
2. The reader creates a QP, moves it to INIT and sends its QPN, GID, LID, PSN,
   MTU and read depth through `exchange` (the agent's ConnectRdma RPC).
3. The holder's `accept` creates a matching QP on the pool's protection domain,
   moves it to RTS against the reader's values and answers with its own.
4. The reader moves its QP to RTR and RTS. Reads may start.

A read (`RdmaChannel.read`): coalesced segments are split at the port's
maximum message size, posted as chains of up to POST_CHAIN_WR_MAX work
requests, with at most SEND_WR_MAX outstanding on the QP; only every
SIGNAL_EVERY_WR-th request (and the last) asks for a completion (RC completes
in order, so one completion retires everything before it). Completions are
polled on the caller's thread with a backoff sleep, so an idle channel costs
nothing and a busy one does not pin a core. Every read has a deadline: a dead
peer never completes an RDMA READ on rxe, so on expiry the QP is moved to ERR
(which flushes all outstanding work), destroyed, and the next read connects
afresh. Any error completion does the same (the QP is in ERR by then).

Destinations outside registered memory (the fetcher's header scratch) land
in a per-channel bounce buffer up to BOUNCE_BYTES and are copied out; larger
ones are registered for the duration of the read.

pyverbs is imported at module load: `transfer.engine` imports this module
only when a configuration names "rdma".
"""

from __future__ import annotations

import logging
import mmap
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyverbs.device as d
import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

from kvdir.transfer.base import (
    AccessDenied,
    Channel,
    PeerUnavailable,
    Read,
    Region,
    TransferError,
    Transport,
    check_destination,
    coalesce,
)
from kvdir.transfer.memory import Registry, buffer_address
from kvdir.transfer.rdma_support import Exchange, RdmaErrors, RdmaOptions

log = logging.getLogger("kvdir.transfer.rdma")

QP_INFO_VERSION = "1"
SEND_WR_MAX = 256
"""Outstanding READ work requests per QP (the send queue's depth)."""
POST_CHAIN_WR_MAX = 32
"""Work requests linked into one post_send call."""
SIGNAL_EVERY_WR = 16
"""Selective signaling: one completion per this many requests (SEND_WR_MAX is a multiple)."""
RD_ATOMIC_MAX = 16
"""READs in flight on the wire per QP (capped by the device's max_qp_rd_atom)."""
WR_BYTES_MAX = 1 << 30
"""A request never exceeds this, nor the port's max_msg_sz."""
CQ_POLL_BATCH = 64
BOUNCE_BYTES = 1 << 20
HOLDER_QPS_MAX = 1024
"""QPs a holder keeps for readers; the oldest goes first past this."""
POLL_SPIN = 64
POLL_SLEEP_MIN_S = 20e-6
POLL_SLEEP_MAX_S = 1e-3
FLUSH_WAIT_S = 1.0
QP_TIMEOUT = 14
"""Local ACK timeout exponent: 4.096 us * 2**14 = 67 ms per retry."""
QP_RETRY_CNT = 7
ACCESS_POOL = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
ACCESS_LOCAL = e.IBV_ACCESS_LOCAL_WRITE


_WC_STATUS = {
    getattr(e, n): n
    for n in dir(e)
    if n.startswith("IBV_WC_") and (n.endswith("_ERR") or n == "IBV_WC_SUCCESS")
}
_DENIED = {e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_REM_INV_REQ_ERR}
_PEER_GONE = {e.IBV_WC_RETRY_EXC_ERR, e.IBV_WC_RNR_RETRY_EXC_ERR, e.IBV_WC_RESP_TIMEOUT_ERR}
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


@dataclass(frozen=True, slots=True)
class PortInfo:
    device: str
    port: int
    gid_index: int
    gid: str
    lid: int
    mtu: int
    max_msg_bytes: int
    rd_atomic: int
    link_layer: str


def _open(opts: RdmaOptions) -> tuple[d.Context, PortInfo]:
    names = [dev.name.decode() for dev in d.get_device_list()]
    if not names:
        raise PeerUnavailable("no RDMA device found (is a driver loaded? see `ibv_devices`)")
    if opts.device and opts.device not in names:
        raise PeerUnavailable(f"RDMA device {opts.device!r} not found (have: {', '.join(names)})")
    for name in [opts.device] if opts.device else names:
        ctx = d.Context(name=name)
        dev_attr = ctx.query_device()
        ports = [opts.port] if opts.port else range(1, dev_attr.phys_port_cnt + 1)
        for port in ports:
            attr = ctx.query_port(port)
            if attr.state != e.IBV_PORT_ACTIVE:
                continue
            gid_index = opts.gid_index if opts.gid_index >= 0 else _pick_gid(ctx, port, attr)
            gid = str(ctx.query_gid(port, gid_index))
            rd = max(1, min(RD_ATOMIC_MAX, dev_attr.max_qp_rd_atom, dev_attr.max_qp_init_rd_atom))
            ib = attr.link_layer == e.IBV_LINK_LAYER_INFINIBAND
            return ctx, PortInfo(
                name,
                port,
                gid_index,
                gid,
                attr.lid,
                attr.active_mtu,
                attr.max_msg_sz,
                rd,
                "infiniband" if ib else "ethernet",
            )
        ctx.close()
    raise PeerUnavailable(f"no active port on {opts.device or ', '.join(names)}")


def _pick_gid(ctx: d.Context, port: int, attr: Any) -> int:
    """RoCE: the first RoCE v2 GID that maps an IPv4 address (else any RoCE v2); IB: 0."""
    if attr.link_layer == e.IBV_LINK_LAYER_INFINIBAND:
        return 0
    v2 = []
    for i in range(attr.gid_tbl_len):
        try:
            gid = str(ctx.query_gid(port, i))
            kind = ctx.query_gid_type(port, i)
        except PyverbsError:
            continue
        if gid.replace(":", "").strip("0") == "":
            continue
        if kind in (e.IBV_GID_TYPE_SYSFS_ROCE_V2, e.IBV_GID_TYPE_ROCE_V2):
            if gid.startswith("0000:0000:0000:0000:0000:ffff:"):
                return i
            v2.append(i)
    if v2:
        return v2[0]
    raise PeerUnavailable(f"port {port} has no RoCE v2 GID (is an IP address configured?)")


def _wc_name(status: int) -> str:
    return _WC_STATUS.get(status, f"status {status}")


class _Bounce:
    """A page-aligned registered scratch buffer."""

    def __init__(self, pd: PD, size: int) -> None:
        self.mm = mmap.mmap(-1, size)
        self.view = memoryview(self.mm)
        self.address = buffer_address(self.view)
        self.mr = MR(pd, size, ACCESS_LOCAL, address=self.address)

    def close(self) -> None:
        self.mr.close()
        self.view.release()
        self.mm.close()


class RdmaTransport(Transport):
    name = "rdma"

    def __init__(
        self,
        options: RdmaOptions | None = None,
        registry: Registry | None = None,
        exchange: Exchange | None = None,
    ) -> None:
        self.options = options or RdmaOptions()
        self.registry = registry or Registry()
        self.exchange = exchange or self.options.exchange
        self.errors = self.options.errors or RdmaErrors()
        self.ctx, self.port = _open(self.options)
        self.pd = PD(self.ctx)
        self._lock = threading.Lock()
        self._mrs: list[tuple[int, int, MR]] = []
        self._held: OrderedDict[int, tuple[QP, CQ]] = OrderedDict()
        self._channels: set[RdmaChannel] = set()
        self._rng = random.SystemRandom()

    # ---------------------------------------------------------- memory

    def register(self, memory: memoryview) -> Region:
        """Register `memory` for remote reads; its rkey is the region's (what peers use)."""
        address = buffer_address(memory)
        with self._lock:
            for a, n, mr in self._mrs:
                if a == address and n == memory.nbytes:
                    return self.registry.register(memory, rkey=mr.rkey)
            try:
                mr = MR(self.pd, memory.nbytes, ACCESS_POOL, address=address)
            except PyverbsError as err:
                raise TransferError(
                    f"cannot register {memory.nbytes} bytes for RDMA: {err} "
                    "(memlock limit? see `ulimit -l`)"
                ) from err
            self._mrs.append((address, memory.nbytes, mr))
        return self.registry.register(memory, rkey=mr.rkey)

    def lkey_for(self, address: int, length: int) -> int | None:
        """The lkey of a registered region covering [address, address+length), if any."""
        with self._lock:
            for a, n, mr in self._mrs:
                if a <= address and address + length <= a + n:
                    return int(mr.lkey)
        return None

    # ---------------------------------------------------------- queue pairs

    def new_qp(self) -> tuple[QP, CQ]:
        cq = CQ(self.ctx, SEND_WR_MAX * 2, None, None, 0)
        cap = QPCap(max_send_wr=SEND_WR_MAX, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        try:
            qp = QP(self.pd, init)
        except PyverbsError:
            cq.close()
            raise
        return qp, cq

    def local_params(self, qp: QP, psn: int) -> dict[str, str]:
        p = self.port
        return {
            "version": QP_INFO_VERSION,
            "qpn": str(qp.qp_num),
            "gid": p.gid,
            "lid": str(p.lid),
            "psn": str(psn),
            "mtu": str(p.mtu),
            "rd_atomic": str(p.rd_atomic),
        }

    def bring_up(self, qp: QP, local_psn: int, remote: dict[str, str]) -> None:
        """INIT -> RTR -> RTS against the peer's params."""
        p = self.port
        if remote.get("version") != QP_INFO_VERSION:
            raise PeerUnavailable(f"rdma wire version {remote.get('version')!r} is not supported")
        try:
            qpn, psn, lid = int(remote["qpn"]), int(remote["psn"]), int(remote["lid"])
            mtu, rd = int(remote["mtu"]), int(remote["rd_atomic"])
            gid = GID()
            gid.gid = remote["gid"]
        except (KeyError, ValueError) as err:
            raise PeerUnavailable(f"bad rdma connection params: {err}") from err
        attr = QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_LOCAL_WRITE
        attr.pkey_index = 0
        attr.port_num = p.port
        attr.path_mtu = min(p.mtu, mtu)
        attr.dest_qp_num = qpn
        attr.rq_psn = psn
        attr.max_dest_rd_atomic = p.rd_atomic
        attr.min_rnr_timer = 12
        gr = GlobalRoute(dgid=gid, sgid_index=p.gid_index, hop_limit=64)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=p.port, dlid=lid)
        attr.sq_psn = local_psn
        attr.timeout = QP_TIMEOUT
        attr.retry_cnt = QP_RETRY_CNT
        attr.rnr_retry = 7
        attr.max_rd_atomic = max(1, min(p.rd_atomic, rd))
        try:
            qp.to_init(attr)
            qp.to_rtr(attr)
            qp.to_rts(attr)
        except PyverbsError as err:
            raise PeerUnavailable(f"cannot connect the RC queue pair: {err}") from err

    def psn(self) -> int:
        return self._rng.getrandbits(24)

    def accept(self, remote: dict[str, str]) -> dict[str, str]:
        """Holder side of ConnectRdma: a QP on the pool's PD, connected to the reader's."""
        try:
            qp, cq = self.new_qp()
        except PyverbsError:
            self.errors.add("accept")
            raise
        psn = self.psn()
        try:
            self.bring_up(qp, psn, remote)
        except PeerUnavailable:
            self.errors.add("accept")
            qp.close()
            cq.close()
            raise
        evicted = []
        with self._lock:
            old = remote.get("replaces", "")
            if old.isdigit() and int(old) in self._held:
                evicted.append(self._held.pop(int(old)))
            self._held[qp.qp_num] = (qp, cq)
            while len(self._held) > HOLDER_QPS_MAX:
                evicted.append(self._held.popitem(last=False)[1])
        for q, c in evicted:
            q.close()
            c.close()
        return self.local_params(qp, psn)

    @property
    def held_qps(self) -> int:
        with self._lock:
            return len(self._held)

    # ---------------------------------------------------------- interface

    def descriptor(self) -> dict[str, str]:
        p = self.port
        return {
            "transport": self.name,
            "version": QP_INFO_VERSION,
            "device": p.device,
            "port": str(p.port),
            "gid": p.gid,
            "lid": str(p.lid),
            "mtu": str(p.mtu),
            "link_layer": p.link_layer,
            "endpoint": self.options.endpoint,
            "node_id": self.options.node_id,
        }

    def connect(self, descriptor: dict[str, str]) -> Channel:
        if self.exchange is None:
            raise PeerUnavailable("this rdma transport has no way to reach peers (no exchange)")
        if descriptor.get("link_layer", self.port.link_layer) != self.port.link_layer:
            raise PeerUnavailable("the peer's RDMA port is on another link layer")
        ch = RdmaChannel(self, descriptor, self.exchange)
        with self._lock:
            self._channels.add(ch)
        return ch

    def forget(self, ch: RdmaChannel) -> None:
        with self._lock:
            self._channels.discard(ch)

    def close(self) -> None:
        with self._lock:
            channels = list(self._channels)
            held = list(self._held.values())
            self._held.clear()
            mrs = list(self._mrs)
            self._mrs.clear()
        for ch in channels:
            ch.close()
        for qp, cq in held:
            qp.close()
            cq.close()
        for _, _, mr in mrs:
            self.registry.deregister(int(mr.rkey))
            mr.close()
        self.pd.close()
        self.ctx.close()


@dataclass(slots=True)
class _Piece:
    remote: int
    rkey: int
    length: int
    local: int


class RdmaChannel(Channel):
    """Reader side: one RC QP to one holder; reads are serialised per channel."""

    def __init__(self, transport: RdmaTransport, descriptor: dict[str, str], ex: Exchange) -> None:
        self.t = transport
        self.descriptor = dict(descriptor)
        self.exchange = ex
        self.peer = descriptor.get("node_id") or descriptor.get("endpoint") or "peer"
        self._lock = threading.Lock()
        self._qp: QP | None = None
        self._cq: CQ | None = None
        self._remote_qpn = ""
        self._bounce: _Bounce | None = None
        self.reconnects = 0
        with self._lock:
            self._connect()

    def _connect(self) -> None:
        try:
            qp, cq = self.t.new_qp()
        except PyverbsError:
            self.t.errors.add("connect")
            raise
        psn = self.t.psn()
        params = self.t.local_params(qp, psn)
        if self._remote_qpn:
            params["replaces"] = self._remote_qpn
        try:
            remote = self.exchange(self.descriptor, params)
            self.t.bring_up(qp, psn, remote)
        except BaseException:
            self.t.errors.add("connect")
            qp.close()
            cq.close()
            raise
        self._qp, self._cq, self._remote_qpn = qp, cq, remote["qpn"]

    def _teardown(self) -> None:
        """Destroy the QP (the NIC writes nothing into our memory through it after this)."""
        if self._qp is not None:
            self._qp.close()
        if self._cq is not None:
            self._cq.close()
        self._qp = self._cq = None

    def read(self, reads: Sequence[Read], dst: memoryview, timeout_s: float) -> int:
        check_destination(reads, len(dst))
        merged = coalesce(reads)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._qp is None:
                self.reconnects += 1
                self._connect()
            return self._read_locked(merged, dst, deadline)

    def _read_locked(self, merged: list[Read], dst: memoryview, deadline: float) -> int:
        total = sum(r.length for r in merged)
        base = buffer_address(dst)
        lkey = self.t.lkey_for(base, len(dst))
        bounce: _Bounce | None = None
        temp: MR | None = None
        if lkey is None:
            if total <= BOUNCE_BYTES and len(dst) <= BOUNCE_BYTES:
                if self._bounce is None:
                    self._bounce = _Bounce(self.t.pd, BOUNCE_BYTES)
                bounce = self._bounce
                local_base, lkey = bounce.address, int(bounce.mr.lkey)
            else:
                temp = MR(self.t.pd, len(dst), ACCESS_LOCAL, address=base)
                local_base, lkey = base, int(temp.lkey)
        else:
            local_base = base
        try:
            self._run(self._pieces(merged, local_base), lkey, deadline)
        finally:
            if temp is not None:
                temp.close()  # after _run: the QP is idle or destroyed by now
        if bounce is not None:
            for r in merged:
                dst[r.dst_offset : r.dst_offset + r.length] = bounce.view[
                    r.dst_offset : r.dst_offset + r.length
                ]
        return total

    def _pieces(self, merged: list[Read], local_base: int) -> list[_Piece]:
        cap = min(WR_BYTES_MAX, self.t.port.max_msg_bytes)
        out = []
        for r in merged:
            for pos in range(0, r.length, cap):
                n = min(cap, r.length - pos)
                local = local_base + r.dst_offset + pos
                out.append(_Piece(r.remote_address + pos, r.rkey, n, local))
        return out

    def _run(self, pieces: list[_Piece], lkey: int, deadline: float) -> None:
        qp, cq = self._qp, self._cq
        assert qp is not None and cq is not None
        n = len(pieces)
        posted = retired = 0
        sleep_s = 0.0
        idle_polls = 0
        while retired < n:
            while posted < n and posted - retired < SEND_WR_MAX:
                k = min(POST_CHAIN_WR_MAX, n - posted, SEND_WR_MAX - (posted - retired))
                self._post(qp, pieces, posted, k, lkey, self.t.errors)
                posted += k
            _, wcs = cq.poll(CQ_POLL_BATCH)
            if wcs:
                sleep_s, idle_polls = 0.0, 0
                for wc in wcs:
                    if wc.status != e.IBV_WC_SUCCESS:
                        self._fail(pieces[wc.wr_id], wc.status, posted - retired)
                    retired = max(retired, wc.wr_id + 1)
                continue
            if time.monotonic() >= deadline:
                self._expire(posted - retired, n)
            idle_polls += 1
            if idle_polls > POLL_SPIN:
                sleep_s = min(POLL_SLEEP_MAX_S, max(POLL_SLEEP_MIN_S, sleep_s * 2))
                time.sleep(max(0.0, min(sleep_s, deadline - time.monotonic())))

    @staticmethod
    def _post(
        qp: QP, pieces: list[_Piece], start: int, k: int, lkey: int, errors: RdmaErrors
    ) -> None:
        n = len(pieces)
        # pyverbs links C structs but keeps no reference to the next SendWR: every
        # object of the chain must stay alive (in `chain`) until post_send returns.
        chain: list[SendWR] = []
        for i in range(start + k - 1, start - 1, -1):
            p = pieces[i]
            signaled = (i + 1) % SIGNAL_EVERY_WR == 0 or i == n - 1
            wr = SendWR(
                wr_id=i,
                opcode=e.IBV_WR_RDMA_READ,
                num_sge=1,
                sg=[SGE(p.local, p.length, lkey)],
                send_flags=e.IBV_SEND_SIGNALED if signaled else 0,
            )
            wr.set_wr_rdma(p.rkey, p.remote)
            if chain:
                wr.next_wr = chain[-1]
            chain.append(wr)
        try:
            qp.post_send(chain[-1])
        except PyverbsError as err:
            errors.add("post")
            raise TransferError(f"post_send failed: {err}") from err

    def _fail(self, piece: _Piece, status: int, outstanding: int) -> None:
        """An error completion: the QP is in ERR; flush, destroy, raise the right error."""
        name = _wc_name(status)
        self.t.errors.add("completion", name)
        self._abort(outstanding)
        where = f"{piece.length} bytes at {piece.remote:#x} under rkey {piece.rkey:#x}"
        if status in _DENIED:
            raise AccessDenied(
                f"rdma read of {where} from {self.peer} refused ({name}): the rkey is not "
                "granted or the range falls outside the holder's registered memory"
            )
        if status in _PEER_GONE:
            raise PeerUnavailable(f"rdma read of {where}: {self.peer} does not answer ({name})")
        raise TransferError(f"rdma read of {where} from {self.peer} failed ({name})")

    def _expire(self, outstanding: int, n: int) -> None:
        self.t.errors.add("deadline")
        self._abort(outstanding)
        raise PeerUnavailable(
            f"rdma read deadline passed with {outstanding} of {n} requests outstanding: "
            f"{self.peer} is not answering (QP flushed and will reconnect)"
        )

    def _abort(self, outstanding: int) -> None:
        """Move the QP to ERR (flushing outstanding work), drain briefly, destroy it."""
        qp, cq = self._qp, self._cq
        if qp is not None and cq is not None:
            try:
                qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
                end = time.monotonic() + FLUSH_WAIT_S
                while outstanding > 0 and time.monotonic() < end:
                    got, _ = cq.poll(CQ_POLL_BATCH)
                    outstanding -= got
                    if not got:
                        time.sleep(POLL_SLEEP_MAX_S)
            except PyverbsError as err:
                self.t.errors.add("flush")
                log.warning("flushing an rdma queue pair failed: %s", err)
        self._teardown()

    def close(self) -> None:
        with self._lock:
            self._teardown()
            if self._bounce is not None:
                self._bounce.close()
                self._bounce = None
        self.t.forget(self)


def device_names() -> list[str]:
    return [dev.name.decode() for dev in d.get_device_list()]
