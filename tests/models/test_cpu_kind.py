"""The CPU kind the engine's choices follow: native bf16 from the flags, capped by ATEN_CPU_CAPABILITY."""

from __future__ import annotations

import pytest
import torch
from dspark.engine.config import resolve_dtype
from dspark.models import cpu_kind

CPU = torch.device("cpu")
AMX = "flags\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "flags\t: fpu avx2 avx512f avx512_bf16\n"
AVX2 = "flags\t: fpu avx2 fma\n"


@pytest.fixture
def flags(monkeypatch):
    def use(line: str, capability: str | None = None) -> None:
        monkeypatch.setattr(cpu_kind, "_flags", lambda: line)
        if capability is None:
            monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        cpu_kind.cpu_has_native_bf16.cache_clear()

    yield use
    cpu_kind.cpu_has_native_bf16.cache_clear()


@pytest.mark.parametrize(
    "line,capability,kind",
    [
        (AMX, None, "AMX"),
        (ZEN4, None, "avx512_bf16"),
        (AVX2, None, "AVX2, no bf16"),
        (ZEN4, "avx512", "avx512_bf16"),
        (ZEN4, "AVX2", "AVX2, no bf16"),
        (AMX, "default", "AVX2, no bf16"),
    ],
)
def test_kind_follows_flags_and_the_capability_cap(flags, line, capability, kind):
    flags(line, capability)
    assert cpu_kind.cpu_kind() == kind
    native = kind != "AVX2, no bf16"
    assert cpu_kind.cpu_has_native_bf16() is native
    assert resolve_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)
