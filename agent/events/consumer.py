"""The ZMQ side: one SUB socket (and a replay DEALER) per engine DP rank.

`RankConsumer` runs one thread per rank: receive ``[topic, seq, payload]``,
decode, sequence, apply to the engine's `IndexHolders`. Ordering contract:
batches of one rank are applied strictly in sequence order, each exactly once
per engine incarnation; a gap is filled from the replay socket *before* the
live batch that revealed it is applied.

Failure handling (the thread never dies of input):
- a malformed message or event is counted (`decode_errors`) and skipped;
- a gap the replay cannot fill (no replay endpoint, timeout, buffer already
  past it) is counted (`gaps_unrecovered`) and the stream goes on: entries are
  routing hints, and the next store or removal of a block corrects it;
- a sequence number that goes backwards is an engine restart: the rank's
  entries are withdrawn, then the new stream is applied from its start; so is
  a gap whose replay shows another payload under the last number we applied
  (a restart whose first messages we missed);
- after the SUB socket (re)connects, the first live batch is checked the same
  way even when its number is the one we expect: a restarted engine whose
  first messages ZMQ dropped (the slow joiner) can land exactly on our next
  number, and would otherwise keep the old engine's entries forever.

Sockets: the engine binds when its endpoint has ``*``/``::`` or is ipc, so we
connect; with ``bind = true`` (the engine was told to connect) we bind. A DP
rank's endpoints are the engine's offset by the rank (port + rank, like vLLM).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash
import zmq

from kvdir.agent.events.decode import END_SEQ, Batch, DecodeError, decode_batch, decode_seq
from kvdir.agent.events.holders import IndexHolders
from kvdir.agent.events.sequence import Sequencer, Step

log = logging.getLogger("kvdir.agent.events")

POLL_MS = 100
RCVHWM = 100_000
REPLAY_BATCHES_MAX = 100_000
LINGER_MS = 0
_RESTARTED = object()


def offset_endpoint(endpoint: str, rank: int) -> str:
    """A DP rank's endpoint: tcp port + rank (port 0 kept), other schemes `_dp<rank>`."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


@dataclass
class RankStats:
    """Counters of one rank's stream (read by the metrics collector)."""

    messages: int = 0
    batches_applied: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    decode_errors: int = 0
    skipped_events: int = 0
    gaps: int = 0
    gaps_unrecovered: int = 0
    batches_lost: int = 0
    replays: int = 0
    replayed_batches: int = 0
    restarts: int = 0
    apply_failures: int = 0
    last_seq: int = -1
    lag_s: float = 0.0


class RankConsumer:
    """Consume one engine DP rank's event stream into `holders`."""

    def __init__(
        self,
        holders: IndexHolders,
        rank: int,
        endpoint: str,
        replay_endpoint: str = "",
        bind: bool = False,
        topic: str = "",
        replay_timeout_s: float = 1.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        observer: Callable[[Batch], None] | None = None,
    ) -> None:
        self.holders = holders
        self.rank = rank
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.bind = bind
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.observer = observer
        """Sees each decoded batch before it is applied (the hash self-test)."""
        self.stats = RankStats()
        self.seq = Sequencer()
        self._generation = 0
        self._last_digest = b""
        self._ctx = context or zmq.Context.instance()
        self._sub: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._reconnected = False
        """The SUB socket (re)connected since the last live batch: verify the next one."""
        self._dealer: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.bound_endpoint = ""

    # ----------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, RCVHWM)
        self._sub.setsockopt(zmq.LINGER, LINGER_MS)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        # Before connect/bind, so the first connection is seen too.
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
        if self.bind:
            self._sub.bind(self.endpoint)
            self.bound_endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sub.connect(self.endpoint)
            self.bound_endpoint = self.endpoint
        name = f"kvdir-events-{self.holders.engine}-dp{self.rank}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---------------------------------------------------------------- loop

    def _run(self) -> None:
        sub = self._sub
        assert sub is not None
        try:
            while not self._stop.is_set():
                if not sub.poll(POLL_MS):
                    continue
                frames = sub.recv_multipart()
                self._drain_monitor()
                try:
                    self.on_message(frames)
                except Exception:  # never let one message end the stream
                    self.stats.apply_failures += 1
                    log.exception("could not apply an event batch", extra=self._where())
        finally:
            if self._monitor is not None:
                sub.disable_monitor()
                self._monitor.close(LINGER_MS)
            sub.close(LINGER_MS)
            if self._dealer is not None:
                self._dealer.close(LINGER_MS)

    def _drain_monitor(self) -> None:
        """Note (re)connections. ZMQ queues the connect event before any message
        of that connection arrives, so draining here, after a receive, sees it."""
        mon = self._monitor
        if mon is None:
            return
        for _ in range(64):  # bounded: a flapping peer cannot stall the stream
            if not mon.poll(0):
                return
            frames = mon.recv_multipart()
            event = int.from_bytes(frames[0][:2], "little") if frames and frames[0] else 0
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self._reconnected = True

    def _where(self) -> dict[str, object]:
        return {"engine": self.holders.engine, "rank": self.rank}

    def on_message(self, frames: list[bytes]) -> None:
        """One live message (public for tests and the benchmark)."""
        self.stats.messages += 1
        if len(frames) != 3:
            self.stats.decode_errors += 1
            return
        try:
            seq = decode_seq(frames[1])
        except DecodeError:
            self.stats.decode_errors += 1
            return
        step = self.seq.observe(seq)
        if self._reconnected:
            self._reconnected = False
            if step is Step.IN_ORDER and self._peer_changed(seq):
                step = Step.RESTART
        if step is Step.RESTART:
            self._restarted(seq)
        if step is not Step.IN_ORDER:
            start = self.seq.missing_from(seq)
            if start is not None:
                if step is Step.GAP:
                    self.stats.gaps += 1
                self._replay(start, seq)
        self._apply(seq, frames[2])

    def _peer_changed(self, live_seq: int) -> bool:
        """After a reconnect: is the engine behind `live_seq` another one than the
        engine whose batch we applied last? Asked of the replay socket, which
        returns the payload under that last number (no replay endpoint or no
        answer: assume the same engine, as before this check existed)."""
        expected = self.seq.expected
        if not self.replay_endpoint or not self._last_digest or not expected:
            return False
        anchor = expected - 1
        self.stats.replays += 1
        got = self._request_replay(anchor, live_seq, anchor)
        if got is None:
            log.warning(
                "could not verify the engine after a reconnect (replay timed out)",
                extra={**self._where(), "seq": live_seq},
            )
        return got is _RESTARTED

    def _restarted(self, seq: int) -> None:
        self.stats.restarts += 1
        log.warning(
            "engine restarted (sequence went back); withdrawing its entries",
            extra={**self._where(), "seq": seq, "expected": self.seq.expected},
        )
        self._generation += 1
        self.holders.clear(self.rank, self._generation)
        self.seq.reset()
        self._last_digest = b""

    def _apply(self, seq: int, payload: bytes) -> None:
        """Decode and apply one batch; the sequence advances even if it is bad."""
        self.seq.applied(seq)
        self._last_digest = xxhash.xxh3_64_digest(payload)
        self.stats.last_seq = seq
        try:
            batch = decode_batch(payload)
        except DecodeError:
            self.stats.decode_errors += 1
            return
        self.apply_batch(batch)

    def apply_batch(self, batch: Batch) -> None:
        st = self.stats
        st.decode_errors += batch.bad_events
        if self.observer is not None:
            self.observer(batch)
        self._generation += 1
        done = self.holders.apply(self.rank, batch, self._generation)
        st.batches_applied += 1
        st.events += len(batch.events)
        st.blocks_stored += done.stored_blocks
        st.blocks_removed += done.removed_blocks
        st.clears += done.clears
        st.skipped_events += done.skipped_events
        st.decode_errors += done.bad_events
        st.lag_s = max(0.0, time.time() - batch.ts)
        if done.reasons:
            log.error(
                "events skipped", extra={**self._where(), "reasons": sorted(set(done.reasons))[:5]}
            )

    # -------------------------------------------------------------- replay

    def _replay(self, start: int, live_seq: int) -> None:
        """Fill [start, live_seq) from the replay socket, as far as it goes.

        A gap may also hide an engine restart whose first messages were lost (the
        new numbering already past ours). So the replay starts one batch early, at
        the last one we applied: if the engine returns a different payload under
        that number, it is not the engine we were following.
        """
        if not self.replay_endpoint:
            self._lost(live_seq - start, "no replay endpoint")
            return
        self.stats.replays += 1
        anchor = start - 1 if start > 0 and self._last_digest else None
        got = self._request_replay(start if anchor is None else anchor, live_seq, anchor)
        if got is _RESTARTED:
            self._restarted(live_seq)
            self._replay(0, live_seq)
            return
        if got is None:
            self._lost(live_seq - (self.seq.expected or start), "replay timed out")
            return
        expected = self.seq.expected if self.seq.expected is not None else start
        if expected < live_seq:
            self._lost(live_seq - expected, "replay buffer no longer holds them")

    def _lost(self, batches: int, why: str) -> None:
        self.stats.gaps_unrecovered += 1
        self.stats.batches_lost += max(0, batches)
        log.warning("event batches lost", extra={**self._where(), "batches": batches, "why": why})

    def _dealer_socket(self) -> zmq.Socket[bytes]:
        if self._dealer is None:
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, LINGER_MS)
            d.connect(self.replay_endpoint)
            self._dealer = d
        return self._dealer

    def _drop_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(LINGER_MS)
            self._dealer = None

    def _request_replay(self, start: int, live_seq: int, anchor: int | None) -> object:
        """Apply the replayed batches we miss: the count received, None on a
        timeout, _RESTARTED when the anchor batch is not the one we applied."""
        dealer = self._dealer_socket()
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + self.replay_timeout_s
        received = 0
        while received <= REPLAY_BATCHES_MAX:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(left_ms):
                self._drop_dealer()  # a late reply must not answer the next request
                return None
            frames = dealer.recv_multipart()
            # [b"", seq, payload] (vLLM < 0.26, SGLang) or [b"", topic, seq, payload].
            if len(frames) not in (3, 4) or frames[0]:
                self.stats.decode_errors += 1
                continue
            try:
                seq = decode_seq(frames[-2])
            except DecodeError:
                self.stats.decode_errors += 1
                continue
            if seq == END_SEQ:
                return received
            received += 1
            if seq == anchor and xxhash.xxh3_64_digest(frames[-1]) != self._last_digest:
                self._drop_dealer()  # the rest of this stream is of no use
                return _RESTARTED
            if self.seq.accept_replayed(seq, live_seq):
                expected = self.seq.expected if self.seq.expected is not None else start
                if seq > expected:
                    self._lost(seq - expected, "replay buffer skipped them")
                self.stats.replayed_batches += 1
                self._apply(seq, frames[-1])
        self._drop_dealer()
        return received
