"""The CPUs and memory this process may use: its container's cgroup limits, not the host's. A pod
limited to 4 CPUs on a 64-core node that starts 64 intra-op threads has them throttled against
each other; one that sizes its KV cache from the node's free memory is OOM-killed once the cache
fills.

cgroup v2 (`cpu.max`, `memory.max`, `cpuset.cpus.effective`) and v1 (`cpu.cfs_quota_us`,
`memory.limit_in_bytes`, `cpuset.effective_cpus`) are read along this process's cgroup path up to
the root; the tightest limit wins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value.
_V1_UNLIMITED = 1 << 60


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_dirs(root: Path, proc_cgroup: Path, controller: str) -> Iterator[Path]:
    """This process's cgroup directory for `controller` and each parent up to the mount root.

    v2 lists one "0::<path>" line; v1 one line per hierarchy, "<id>:<controllers>:<path>",
    mounted at `root`/<controllers>.
    """
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base = root
        elif controller in controllers.split(","):
            base = root / controllers
            if not base.is_dir():
                base = root / controller
        else:
            continue
        here = base / path.lstrip("/")
        while True:
            if here.is_dir():
                yield here
            if here == base or base not in here.parents:
                break
            here = here.parent


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """CPUs' worth of time the cgroups allow per period (the tightest), or None without a limit."""
    limits = []
    for d in _cgroup_dirs(root, proc_cgroup, "cpu"):
        if (v2 := _read(d / "cpu.max")) is not None:
            quota, _, period = v2.partition(" ")
            if quota != "max" and period:
                limits.append(int(quota) / int(period))
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota is not None and period is not None and int(quota) > 0:
            limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def cgroup_memory_room(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Bytes the cgroups still allow (limit minus usage, the tightest), or None without a limit."""
    rooms = []
    for d in _cgroup_dirs(root, proc_cgroup, "memory"):
        for limit_file, usage_file in (
            ("memory.max", "memory.current"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            limit, usage = _read(d / limit_file), _read(d / usage_file)
            if limit is None or limit == "max" or int(limit) >= _V1_UNLIMITED:
                continue
            rooms.append(max(0, int(limit) - int(usage or 0)))
    return min(rooms) if rooms else None


def _cpu_list_size(text: str) -> int:
    """How many CPUs a list such as "0-3,8,10-11" names."""
    count = 0
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def cgroup_cpuset_size(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """CPUs the cgroups' cpusets give this process (the innermost that says), or None."""
    for d in _cgroup_dirs(root, proc_cgroup, "cpuset"):
        for name in ("cpuset.cpus.effective", "cpuset.effective_cpus", "cpuset.cpus"):
            if text := _read(d / name):
                return _cpu_list_size(text)
    return None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """CPUs the container gives this process: its cgroup cpuset (else the machine's CPUs), at most
    its cgroup quota rounded down, at least one.

    Not the process's own affinity: the engine process narrows its stepping thread's to one core
    after start-up, and a replica's plan must still count the cores it was given.
    """
    cpus = cgroup_cpuset_size(root, proc_cgroup) or os.cpu_count() or 1
    quota = cgroup_cpu_limit(root, proc_cgroup)
    return max(1, min(cpus, math.floor(quota))) if quota is not None else cpus


def available_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """Bytes this process may still take: the host's available memory (page cache the kernel
    reclaims included), at most what its cgroups leave."""
    host = psutil.virtual_memory().available
    room = cgroup_memory_room(root, proc_cgroup)
    return min(host, room) if room is not None else host
