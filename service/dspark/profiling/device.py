"""The name of the hardware a profile is measured on ("NVIDIA H200", or the CPU model)."""

from __future__ import annotations

import platform
from pathlib import Path


def current_device_name() -> str:
    """The CUDA device name when a GPU is visible, otherwise the CPU model name."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return cpu_model_name()


def cpu_model_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "cpu"
