"""What the benchmarks name as the machine they measured on.

The sessions that produce these results do not always get the same host (Intel Xeon one
day, AMD EPYC the next), and timings from different CPUs are not comparable, so every
results file names the CPU model, not only the architecture."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
