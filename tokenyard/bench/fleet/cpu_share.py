"""How much of the machine's CPU other work took while a measurement ran (Linux, from /proc).

The real-fleet check (validation.py) runs replicas, a gateway and a client on a shared machine;
when other work takes cores away mid-trace, no curve measured before or after can predict the
trace. This measures it instead of guessing: the machine's busy CPU seconds (/proc/stat) less the
CPU seconds of this process and its descendants (/proc/PID/stat), over a window, in cores.

    window = CpuWindow()
    ... the measurement ...
    share = window.stop()   # {"wall_s", "machine_cores", "ours_cores", "others_cores"}
"""
from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (everything but idle and iowait)."""
    fields = [float(x) for x in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user/nice]
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / _ticks()


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds: own user+system and waited-for children's) of one process."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2:].split()       # the name may hold spaces and parentheses
    ppid = int(rest[1])
    utime, stime, cutime, cstime = (float(x) for x in rest[11:15])
    return ppid, (utime + stime + cutime + cstime) / _ticks()


def tree_cpu_s(root: int | None = None) -> dict[int, float]:
    """CPU seconds per process of `root` (default: this process) and all its descendants now."""
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                parent[int(entry.name)], cpu[int(entry.name)] = st
    ours: dict[int, float] = {}
    for pid in cpu:
        p, seen = pid, 0
        while p > 1 and seen < 64:                   # walk up to the root (or init)
            if p == root:
                ours[pid] = cpu[pid]
                break
            p, seen = parent.get(p, 0), seen + 1
    return ours


class CpuWindow:
    """The CPU the machine, this process tree and everything else used from construction to stop()."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy0 = machine_busy_s()
        self.ours0 = tree_cpu_s()

    def stop(self) -> dict[str, float]:
        wall = max(1e-9, time.monotonic() - self.t0)
        busy = machine_busy_s() - self.busy0
        ours1 = tree_cpu_s()
        # A process that ended inside the window loses its last seconds here (counted as others'):
        # the replicas and the gateway live through the whole window, so that is the client's bits.
        ours = sum(ours1[pid] - self.ours0.get(pid, 0.0) for pid in ours1)
        return {"wall_s": round(wall, 3), "machine_cores": round(busy / wall, 3), "ours_cores": round(ours / wall, 3),
                "others_cores": round(max(0.0, busy - ours) / wall, 3)}
