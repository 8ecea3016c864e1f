"""A process's CPU time as the kernel counts it, for the benchmarks that
print CPU per GB beside their figures (tcp14_timeline, tcp20_batch,
tcp24_lone). Imported as a sibling module: each script runs from this
directory's path (sys.path[0])."""

from __future__ import annotations

import os


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system, every thread) pid has used so far, from
    /proc/<pid>/stat in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        st = f.read().rsplit(")", 1)[1].split()
    return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")
