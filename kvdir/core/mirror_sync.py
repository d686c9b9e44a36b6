"""Keeps a `Mirror` fed: one Watch stream, resumed on another replica when it ends.

A background thread holds one `Watch` call at a time. When the stream ends
(the replica died or stopped, cut this watcher off for being slow, installed
a snapshot, or answered OUT_OF_RANGE because it is behind us), it resumes
from the mirror's applied index, on the same replica for a cut-off and on the
next one otherwise; the replica answers with the commands after that index,
or with a snapshot when it no longer holds them. A stream of another
cluster's log (the mirror raised `Resync`) is dropped and reopened at once
from a snapshot. Any replica will do: each
sends only committed commands, and the mirror skips what it already has.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from kvdir.core.mirror import MirrorError, Resync
from kvdir.core.security import PLAIN, ClientSecurity
from kvdir.core.wire import GRPC_MESSAGE_BYTES_MAX
from kvdir.v1 import directory_pb2 as pb
from kvdir.v1 import directory_pb2_grpc as pb_grpc

log = logging.getLogger("kvdir.mirror")

RETRY_S_MIN = 0.05
RETRY_S_MAX = 1.0
"""Pause between reconnections after failures (doubling from the minimum)."""
_SAME_REPLICA = {grpc.StatusCode.RESOURCE_EXHAUSTED}


class WatchTarget(Protocol):
    """What a stream feeds: a `Mirror`, or one group's part of a `ShardedMirror`."""

    @property
    def watched(self) -> list[pb.Namespace]: ...

    def resume_index(self) -> int: ...

    def on_event(self, ev: pb.WatchEvent) -> None: ...

    def fail(self, message: str) -> None: ...


class MirrorSync:
    def __init__(
        self,
        mirror: WatchTarget,
        addresses: Sequence[str],
        security: ClientSecurity = PLAIN,
    ) -> None:
        """Feeds `mirror` from the first replica of `addresses` that serves it; the
        stream is filtered to the mirror's own namespaces (`Mirror.watched`), so the
        two can never disagree on what the table holds."""
        if not addresses:
            raise ValueError("a mirror needs at least one directory address")
        self.mirror = mirror
        self.addresses = list(addresses)
        opts = [
            ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES_MAX),
            ("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES_MAX),
        ]
        self._channels = [security.channel(a, opts) for a in self.addresses]
        self._stubs = [pb_grpc.PrefixDirectoryStub(c) for c in self._channels]
        self._stop = threading.Event()
        self._call: Any = None
        self._call_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvdir-mirror", daemon=True)
        self._at = 0
        self.streams = 0
        self.last_status = ""

    def start(self) -> MirrorSync:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()
        self._thread.join(timeout_s)
        for c in self._channels:
            c.close()

    def __enter__(self) -> MirrorSync:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        pause = RETRY_S_MIN
        while not self._stop.is_set():
            code = self._stream_once()
            if self._stop.is_set():
                return
            if code == "applied":
                pause = RETRY_S_MIN  # it made progress: reconnect at once
                continue
            if code not in {c.name for c in _SAME_REPLICA}:
                self._at = (self._at + 1) % len(self._stubs)
            self._stop.wait(pause)
            pause = min(RETRY_S_MAX, pause * 2)

    def _stream_once(self) -> str:
        """One Watch call; returns "applied" if it delivered anything, else a status name."""
        req = pb.WatchRequest(from_index=self.mirror.resume_index(), namespaces=self.mirror.watched)
        address = self.addresses[self._at]
        got = False
        with self._call_lock:
            if self._stop.is_set():
                return "CANCELLED"
            call = self._call = self._stubs[self._at].Watch(req)
        self.streams += 1
        try:
            for ev in call:
                self.mirror.on_event(ev)
                got = True
            self.last_status = f"{address}: stream ended"
            return "applied" if got else "OK"
        except grpc.RpcError as e:
            status = f"{address}: {e.code().name}: {e.details()}"
            self.last_status = status
            self.mirror.fail(status)
            if e.code() != grpc.StatusCode.CANCELLED:
                log.info("mirror stream ended: %s", status)
            return "applied" if got and e.code() in _SAME_REPLICA else e.code().name
        except Resync as e:
            self.last_status = f"{address}: {e}"
            log.warning("mirror resynchronising: %s", self.last_status)
            call.cancel()  # type: ignore[no-untyped-call]
            return "applied"  # reconnect at once; resume_index() is now 0: a snapshot
        except MirrorError as e:
            # A stream we cannot apply (a newer command format): stop loudly, stay stale.
            self.last_status = f"{address}: {e}"
            self.mirror.fail(self.last_status)
            log.error("mirror stopped: %s", self.last_status)
            self._stop.set()
            call.cancel()  # type: ignore[no-untyped-call]
            return "MIRROR_ERROR"
        finally:
            with self._call_lock:
                self._call = None
