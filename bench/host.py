"""What the host says about itself (Linux /proc and /sys): CPU seconds, memory, load.

Every reader returns a neutral value (NaN, 0, [] or "unknown") where the file
is missing, so a benchmark on an unusual host still writes its report.
`CpuMonitor` turns the readings into "how much of the machine did something
else take during this phase" for hosts shared with other work.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import time
from collections.abc import Callable

_TICK = os.sysconf("SC_CLK_TCK")
CPU_SAMPLE_S = 0.5
"""How often `CpuMonitor` samples (it only needs to see every process before it exits)."""


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (NaN: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / _TICK


def _machine_ticks() -> list[int]:
    """The machine's CPU time per mode so far (/proc/stat's first line), in ticks."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:]]


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far."""
    vals = _machine_ticks()
    total = sum(vals[:8])
    idle = vals[3] + vals[4]
    return (total - idle) / _TICK, total / _TICK


def machine_kernel_cpu() -> tuple[float, float]:
    """(in kernel, total) CPU seconds of the whole machine so far; 'in kernel' is system,
    irq and softirq time: among it the zeroing of every fresh page a process faults in."""
    vals = _machine_ticks()
    return (vals[2] + vals[5] + vals[6]) / _TICK, sum(vals[:8]) / _TICK


FIRST_TOUCH_MIB = 32


def first_touch_us_per_page(mib: int = FIRST_TOUCH_MIB) -> float:
    """Microseconds to fault in one fresh anonymous page: a write to each page of a new
    `mib` MiB mapping (the loop's own ~0.15 us per page included).

    About 1.5-2 us where the host backs the machine's memory already; several
    times that in a VM whose host backs guest memory only when first touched
    or takes freed guest pages back (free page reporting): there a growing
    table pays it for every page it grows by, in whichever process grows."""
    size, page = mib << 20, mmap.PAGESIZE
    with mmap.mmap(-1, size) as m:
        t0 = time.perf_counter()
        for off in range(0, size, page):
            m[off] = 1
        return (time.perf_counter() - t0) / (size // page) * 1e6


def busy_share(c0: tuple[float, float], c1: tuple[float, float]) -> float:
    """The share of the machine between two `machine_cpu()` (busy) or `machine_kernel_cpu()`
    (in kernel) readings."""
    total = c1[1] - c0[1]
    return (c1[0] - c0[0]) / total if total > 0 else math.nan


QUIET_SHARE = 0.25
QUIET_WINDOW_S = 0.1
QUIET_WAIT_S_MAX = 5.0


def wait_machine_quiet(
    share: float = QUIET_SHARE,
    window_s: float = QUIET_WINDOW_S,
    timeout_s: float = QUIET_WAIT_S_MAX,
) -> float:
    """Wait until the machine was busy less than `share` of its CPUs over one `window_s`;
    the seconds waited, or NaN when `timeout_s` passed first (the caller records it).

    Why a benchmark needs it: a vLLM worker busy-polls its message queue for a second
    after every step (vLLM 0.32's shm queue readers), so a measurement started right
    after another engine answered shares a 2-core host with a spinning process, and
    one started a second later does not."""
    t0 = time.monotonic()
    while True:
        c0 = machine_cpu()
        time.sleep(window_s)  # the window the share is measured over, not a wait
        if busy_share(c0, machine_cpu()) < share:
            return time.monotonic() - t0
        if time.monotonic() - t0 >= timeout_s:
            return math.nan


def _status_kib(path: str, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes(pid: int) -> int:
    """VmRSS of process `pid` (0: gone)."""
    return _status_kib(f"/proc/{pid}/status", "VmRSS:")


def mem_available_bytes() -> int:
    return _status_kib("/proc/meminfo", "MemAvailable:")


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages ([] where the host does not say)."""
    try:
        return list(os.getloadavg())
    except OSError:
        return []


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


class CpuMonitor(threading.Thread):
    """Samples machine CPU and this benchmark's own processes every `CPU_SAMPLE_S`.

    The host may be shared: `foreign` is machine busy time not spent in the
    benchmark's processes (`pids()`), so a phase can say how much of the
    machine something else took.
    """

    def __init__(self, pids: Callable[[], list[int]], max_s: float) -> None:
        super().__init__(name="bench-cpu-monitor", daemon=True)
        self.pids, self.max_s = pids, max_s
        self.lock = threading.Lock()
        self.busy = self.total = self.own = 0.0
        self._last: dict[int, float] = {}
        self._machine = machine_cpu()
        self.stop_ev = threading.Event()
        self.sample()

    def sample(self) -> None:
        m = machine_cpu()
        own = 0.0
        for pid in self.pids():
            now = proc_cpu_s(pid)
            if math.isnan(now):
                continue
            own += max(0.0, now - self._last.get(pid, now))
            self._last[pid] = now
        with self.lock:
            self.busy += m[0] - self._machine[0]
            self.total += m[1] - self._machine[1]
            self.own += own
            self._machine = m

    def run(self) -> None:
        rounds = int(self.max_s / CPU_SAMPLE_S) + 1
        for _ in range(rounds):
            if self.stop_ev.wait(CPU_SAMPLE_S):
                return
            self.sample()

    def totals(self) -> tuple[float, float, float]:
        """(machine busy, machine total, own) CPU seconds since the monitor started."""
        self.sample()
        with self.lock:
            return self.busy, self.total, self.own

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(timeout=5)
