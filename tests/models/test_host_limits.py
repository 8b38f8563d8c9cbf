"""CPUs and memory from the container's cgroup limits, v2 and v1, on fake cgroup trees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
from dspark.models.host_limits import available_memory, cgroup_cpu_limit, cgroup_memory_room, usable_cpus

GIB = 2**30


def tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    root.mkdir(exist_ok=True)
    proc_cgroup = tmp_path / "proc-self-cgroup"
    proc_cgroup.write_text(proc)
    return root, proc_cgroup


def test_a_v2_pod_limit_of_four_cpus_gives_four_threads_whatever_the_node_has(tmp_path):
    root, proc = tree(
        tmp_path,
        "0::/kubepods/pod1/c1\n",
        {
            "kubepods/pod1/c1/cpu.max": "max 100000",
            "kubepods/pod1/cpu.max": "400000 100000",
            "kubepods/cpu.max": "max 100000",
        },
    )
    assert cgroup_cpu_limit(root, proc) == 4.0
    assert usable_cpus(root, proc) == min(4, os.cpu_count())


def test_a_fractional_quota_rounds_down_but_never_below_one(tmp_path):
    root, proc = tree(tmp_path, "0::/\n", {"cpu.max": "50000 100000"})
    assert cgroup_cpu_limit(root, proc) == 0.5
    assert usable_cpus(root, proc) == 1
    root, proc = tree(tmp_path / "b", "0::/\n", {"cpu.max": "250000 100000"})
    assert usable_cpus(root, proc) == min(2, os.cpu_count())


def test_no_limit_anywhere_means_the_machines_cpus(tmp_path):
    root, proc = tree(tmp_path, "0::/a\n", {"a/cpu.max": "max 100000", "a/memory.max": "max"})
    assert cgroup_cpu_limit(root, proc) is None
    assert cgroup_memory_room(root, proc) is None
    assert usable_cpus(root, proc) == os.cpu_count()


def test_a_cpuset_limits_the_cpus_and_the_quota_still_applies(tmp_path):
    root, proc = tree(
        tmp_path, "0::/pod/c\n", {"pod/c/cpuset.cpus.effective": "0-5,8,10-11", "pod/cpu.max": "max 100000"}
    )
    assert usable_cpus(root, proc) == 9
    root, proc = tree(
        tmp_path / "b",
        "0::/pod/c\n",
        {"pod/c/cpuset.cpus.effective": "0-5,8,10-11", "pod/cpu.max": "300000 100000"},
    )
    assert usable_cpus(root, proc) == 3


def test_narrowing_this_process_affinity_does_not_shrink_the_replica(tmp_path):
    """The engine process pins its stepping thread to one core after start-up; the thread plan it
    then reads must still count the replica's cores."""
    code = (
        "import os; from dspark.models.host_limits import usable_cpus; "
        "before = usable_cpus(); os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "print(before, usable_cpus())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    assert after == before


def test_v2_memory_room_is_the_tightest_limit_less_usage(tmp_path):
    root, proc = tree(
        tmp_path,
        "0::/pod/c\n",
        {
            "pod/c/memory.max": str(8 * GIB),
            "pod/c/memory.current": str(1 * GIB),
            "pod/memory.max": str(4 * GIB),
            "pod/memory.current": str(3 * GIB),
        },
    )
    assert cgroup_memory_room(root, proc) == 1 * GIB
    assert available_memory(root, proc) == min(1 * GIB, psutil.virtual_memory().available)


def test_v1_quota_and_memory_limit(tmp_path):
    root, proc = tree(
        tmp_path,
        "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n1:name=systemd:/docker/x\n",
        {
            "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "200000",
            "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000",
            "memory/docker/x/memory.limit_in_bytes": str(2 * GIB),
            "memory/docker/x/memory.usage_in_bytes": str(GIB // 2),
            "memory/docker/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
            "memory/docker/memory.usage_in_bytes": str(GIB),
        },
    )
    assert cgroup_cpu_limit(root, proc) == 2.0
    assert cgroup_memory_room(root, proc) == GIB + GIB // 2


def test_v1_without_a_quota_is_no_limit(tmp_path):
    root, proc = tree(
        tmp_path,
        "4:cpu,cpuacct:/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
    )
    assert cgroup_cpu_limit(root, proc) is None


def test_this_machine_reads_without_error():
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)
    assert 0 < available_memory() <= psutil.virtual_memory().total
