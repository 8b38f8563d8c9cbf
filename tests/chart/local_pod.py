"""A kubelet for a machine without containers: runs a pod's container as a local process.

The container's command, args and env run as written, with only what a node gives a pod mapped
onto this machine:
- each volume is a local directory (an emptyDir empty, a configMap with its keys or items written);
- an env value under a mount path points into that volume's directory. The argv must not name a
  mount path itself: a command reaches its volumes through its environment, so it runs anywhere;
- the container image's `dspark` and `python` are this interpreter's (PATH, PYTHONPATH);
- the root filesystem is read-only in the pod: HOME and the working directory are an empty
  directory of the pod's own, mode 0555, and `written_to_rootfs()` lists what landed there anyway
  (root ignores the mode), each a write that fails in the pod;
- `flags` replaces the values of flags the caller names (each must be in the argv), and
  `extra_args` and `extra_env` add to them, for what this machine cannot give as the cluster
  would: the GPU, the pod's own network address and port, the hub.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LocalPod:
    name: str
    proc: subprocess.Popen
    log_path: Path
    rootfs: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def written_to_rootfs(self) -> list[Path]:
        return sorted(self.rootfs.rglob("*"))

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM as the kubelet sends it, then whatever of the pod's process group is left."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def _volume_dirs(pod_spec: dict[str, Any], configmaps: Mapping[str, dict], root: Path) -> dict[str, Path]:
    dirs = {}
    for volume in pod_spec.get("volumes") or []:
        path = root / "v" / volume["name"]  # short: Ray's socket paths under /tmp
        path.mkdir(parents=True)
        if "configMap" in volume:
            source = volume["configMap"]
            data = configmaps[source["name"]]["data"]
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                (path / item["path"]).write_text(data[item["key"]])
        elif "emptyDir" not in volume:
            raise AssertionError(f"volume {volume['name']!r}: only emptyDir and configMap run here")
        dirs[volume["name"]] = path
    return dirs


def _localize(value: str, mounts: list[tuple[str, Path]]) -> str:
    for mount_path, local in mounts:
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(local) + value[len(mount_path.rstrip("/")) :]
    return value


def _replace_flags(argv: list[str], flags: Mapping[str, str]) -> list[str]:
    argv = list(argv)
    for flag, value in flags.items():
        assert flag in argv, f"{flag} is not in the container's command {argv}"
        argv[argv.index(flag) + 1] = value
    return argv


def container_env(container: dict[str, Any], mounts: list[tuple[str, Path]]) -> dict[str, str]:
    env = {}
    for entry in container.get("env") or []:
        assert "value" in entry, f"env {entry['name']}: only literal values run here"
        env[entry["name"]] = _localize(entry["value"], mounts)
    return env


def start_pod(
    name: str,
    pod_spec: dict[str, Any],
    root: Path,
    configmaps: Mapping[str, dict] | None = None,
    flags: Mapping[str, str] | None = None,
    extra_args: list[str] | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> LocalPod:
    """Start the pod's only container under `root` (its volumes, log and read-only home)."""
    (container,) = pod_spec["containers"]
    root.mkdir(parents=True, exist_ok=True)
    volumes = _volume_dirs(pod_spec, configmaps or {}, root)
    # Longest mount path first, so a nested mount wins over its parent.
    mounts = sorted(
        (
            (m["mountPath"], volumes[m["name"]] / m.get("subPath", ""))
            for m in container.get("volumeMounts") or []
        ),
        key=lambda mount: -len(mount[0]),
    )
    argv = [*container.get("command", []), *container.get("args", [])]
    for arg in argv:
        assert _localize(arg, mounts) == arg and not any(f" {m}/" in arg for m, _ in mounts), (
            f"the command names a mount path: {arg!r}"
        )
    argv = [*_replace_flags(argv, flags or {}), *(extra_args or [])]
    if argv[0] == "python":
        argv[0] = sys.executable
    readonly = root / "rootfs"
    readonly.mkdir()
    readonly.chmod(0o555)
    bin_dir = str(Path(sys.executable).parent)
    env = {
        "PATH": os.pathsep.join([bin_dir, "/usr/local/bin", "/usr/bin", "/bin"]),
        "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("service", "operator")),
        "PYTHONUNBUFFERED": "1",
        "HOME": str(readonly),
        **container_env(container, mounts),
        **(extra_env or {}),
    }
    log_path = root / "log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, cwd=readonly, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return LocalPod(name, proc, log_path, readonly)
