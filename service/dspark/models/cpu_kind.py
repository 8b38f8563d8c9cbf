"""What kind of CPU this is, as far as the engine's choices go: native bf16 or not.

`ATEN_CPU_CAPABILITY` caps the instruction set torch and inductor use (`avx2`, `avx512`, `default`);
the engine honours the same cap, so `ATEN_CPU_CAPABILITY=avx2` runs an AVX-512 machine as an AVX2-only
one would run (fp32 by default, no bf16 packing, the kernel built for 256-bit vectors).
"""

from __future__ import annotations

import os
from functools import cache

# Capabilities under which torch runs no AVX-512 kernels, so bf16 has no native units.
_NO_AVX512 = ("default", "avx2")


def _flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def capped_below_avx512() -> bool:
    """`ATEN_CPU_CAPABILITY` asks torch for AVX2 or less."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in _NO_AVX512


@cache
def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX, and not capped below AVX-512: bf16 matmuls are native and faster than fp32."""
    flags = _flags().split()
    return not capped_below_avx512() and ("avx512_bf16" in flags or "amx_bf16" in flags)


def cpu_kind() -> str:
    """`AMX`, `avx512_bf16` or `AVX2, no bf16`: the kind figures are reported by."""
    if not cpu_has_native_bf16():
        return "AVX2, no bf16"
    return "AMX" if "amx_bf16" in _flags().split() else "avx512_bf16"
