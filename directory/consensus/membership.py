"""Who belongs to a directory cluster: Raft addresses and the cluster id fence.

Membership itself is pysyncobj's (dynamic membership changes are log
entries, kept in the journal and in every snapshot). This module adds what
pysyncobj lacks:

- `parse_raft_address`: the one check of a ``HOST:PORT`` an operator types.
- A **cluster id**. A cluster restored from a backup or recovered from a
  survivor gets a new id, kept in ``<data_dir>/cluster-id``. Replicas send it
  with the address they announce when they dial a peer (`FencedTransport`),
  and a replica refuses a peer whose id differs. So a member of the old
  cluster that comes back with its old data (and maybe a higher term and a
  longer log) cannot talk to, vote in, or overwrite the new cluster. A cluster
  that was never restored has the empty id and announces the bare address,
  exactly as replicas without this module do, so a rolling upgrade into this
  version needs no coordination. (The transport that does it is
  `consensus.transport.FencedTransport`; this module holds no Raft library.)
"""

from __future__ import annotations

import os
import re

from kvdir.directory.consensus.sync import replace_durably

CLUSTER_ID_FILE = "cluster-id"
_CLUSTER_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9_.-]{1,253}$|^\[[0-9A-Fa-f:.]{2,45}\]$")
_HELLO_SEP = "#kvdir-cluster="


class MembershipError(ValueError):
    """A malformed address or cluster id; the message says which and why."""


def parse_raft_address(text: str) -> str:
    """``HOST:PORT`` as pysyncobj names a member, validated; raises MembershipError."""
    addr = text.strip()
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not _HOST_RE.match(host):
        raise MembershipError(f"raft address {text!r} is not HOST:PORT")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise MembershipError(f"raft address {text!r} has no port in 1..65535")
    return f"{host}:{int(port)}"


def check_cluster_id(cluster_id: str) -> str:
    if cluster_id and not _CLUSTER_ID_RE.match(cluster_id):
        raise MembershipError(f"cluster id {cluster_id!r} must be 1-64 of [A-Za-z0-9_.-]")
    return cluster_id


def read_cluster_id(data_dir: str) -> str | None:
    """The id recorded in `data_dir`, or None when the directory has none."""
    try:
        with open(os.path.join(data_dir, CLUSTER_ID_FILE), encoding="ascii") as f:
            return check_cluster_id(f.read().strip())
    except FileNotFoundError:
        return None


def write_cluster_id(data_dir: str, cluster_id: str) -> None:
    check_cluster_id(cluster_id)
    path = os.path.join(data_dir, CLUSTER_ID_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(cluster_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    replace_durably(tmp, path)  # a restored replica must not come back unfenced


def resolve_cluster_id(data_dir: str, configured: str) -> str:
    """The id this replica runs with: its data dir's, or the configured one adopted.

    A configured id that differs from the data dir's is refused: that data
    belongs to another cluster.
    """
    check_cluster_id(configured)
    recorded = read_cluster_id(data_dir)
    if recorded is None:
        if configured:
            os.makedirs(data_dir, exist_ok=True)
            write_cluster_id(data_dir, configured)
        return configured
    if configured and configured != recorded:
        raise MembershipError(
            f"data dir {data_dir} belongs to cluster {recorded!r}, the config says "
            f"{configured!r}; use an empty data dir to join {configured!r}"
        )
    return recorded


LOCK_FILE = "lock"


class DataDirBusy(MembershipError):
    """Another process (a running replica, or a restore) holds the data dir."""


def lock_data_dir(data_dir: str) -> int:
    """Hold `data_dir` exclusively until the returned descriptor is closed (or the process ends).

    A replica holds it while it runs; `restore` and `recover` take it too, so
    neither can rewrite the files of a running replica, and two replicas never
    share one data dir. An advisory flock: the kernel drops it with the process.
    """
    import fcntl

    os.makedirs(data_dir, exist_ok=True)
    fd = os.open(os.path.join(data_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirBusy(
            f"{data_dir} is in use by another process (a running replica?); stop it first"
        ) from None
    return fd


def hello(address: str, cluster_id: str) -> str:
    """What a replica announces on a connection it dials."""
    return f"{address}{_HELLO_SEP}{cluster_id}" if cluster_id else address


def split_hello(message: str) -> tuple[str, str]:
    """(address, cluster id) from an announcement; bare addresses are the empty id."""
    address, _, cluster_id = message.partition(_HELLO_SEP)
    return address, cluster_id
