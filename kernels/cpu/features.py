"""What this processor can do, as /proc/cpuinfo says: read without building or loading anything,
so the launcher and the configuration can ask before any kernel exists."""

from __future__ import annotations

import platform


def cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """This processor's feature flags (``avx512f``, ``amx_bf16``, ...) as /proc/cpuinfo names
    them; empty where it does not say."""
    return frozenset(cpu_fingerprint().split())


def has_amx_bf16() -> bool:
    """Whether this processor multiplies bf16 matrices in AMX tiles (``amx_bf16``): its bf16
    GEMMs then run several times faster than float32 ones, which sets step sizes and kernel
    choices beyond the tiles."""
    return "amx_bf16" in cpu_flags()
