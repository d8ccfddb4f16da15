"""What the benchmarks name as the machine they measured on.

The sessions that produce these results do not always get the same host (Intel Xeon one
day, AMD EPYC the next), and timings from different CPUs are not comparable, so every
results file names the CPU model, not only the architecture."""

from __future__ import annotations

import platform


def cpu_signature(cpuinfo: str | None = None) -> str:
    """The first CPU's family, model and stepping from /proc/cpuinfo ("family 25, model 17,
    stepping 1"), or "" where it has none: two VMs with one model name can differ (evidence-v4,
    amendment 3), and these tell more of them apart than the name does."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("cpu family", "model", "stepping") and key not in fields:
            fields[key] = value.strip()
    return ", ".join(f"{key.removeprefix('cpu ')} {fields[key]}" for key in ("cpu family", "model", "stepping")
                     if key in fields)


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
