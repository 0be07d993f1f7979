"""cpu_share: the CPU of this process tree is told apart from the machine's (the real-fleet check's
`quiet` flag rests on it). Linux only (/proc)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenyard.bench.fleet.cpu_share import CpuWindow, machine_busy_s, tree_cpu_s

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc")
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_a_live_child_is_in_the_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.3) + "time.sleep(30)"])
    try:
        time.sleep(0.1)
        deadline = time.monotonic() + 10
        while tree_cpu_s().get(child.pid, 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_s().get(child.pid, 0.0) >= 0.25      # clock ticks: 10 ms resolution
        assert tree_cpu_s(child.pid).keys() == {child.pid}    # a tree rooted elsewhere holds only its own
    finally:
        child.kill()
        child.wait()


def test_the_window_counts_our_work_as_ours() -> None:
    window = CpuWindow()
    subprocess.run([sys.executable, "-c", BURN.format(s=0.4)], check=True)   # waited for: the parent's cutime
    share = window.stop()
    ours_s = share["ours_cores"] * share["wall_s"]
    assert ours_s >= 0.35, share
    # The machine did at least our work (ticks are sampled: 0.05 s of slack); others' is what is left.
    assert share["machine_cores"] * share["wall_s"] >= ours_s - 0.05, share
    assert share["others_cores"] >= 0.0
    assert machine_busy_s() > 0.0
