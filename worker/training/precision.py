"""Which precision a run's forward passes use: bf16 where the hardware does bf16 matrix products
natively, fp32 elsewhere (``train.precision = "auto"``).

bf16 matters on CPUs too: where the cores have bf16 dot-product instructions (x86 AVX512-BF16 or
AMX, Arm's BF16 extension) a bf16 matrix product runs about twice as fast as an fp32 one, and the
training step is mostly matrix products (bench/RESULTS.md, ``bench.train_step``). Without them
oneDNN emulates bf16 and it is slower than fp32, so "auto" keeps fp32 there.
"""

from __future__ import annotations

import platform
import subprocess
from functools import cache
from pathlib import Path
from typing import Literal

Precision = Literal["auto", "bf16", "fp32"]

# /proc/cpuinfo names of native bf16 dot products: x86 AVX512-BF16 and AMX-BF16, Arm FEAT_BF16.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def flags_have_bf16(flags: set[str] | frozenset[str]) -> bool:
    """Whether a CPU with these feature flags does bf16 matrix products natively."""
    return bool(_BF16_FLAGS & set(flags))


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text (x86 "flags", Arm "Features")."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@cache
def cpu_has_bf16() -> bool:
    """This machine's CPU does bf16 natively (Linux: /proc/cpuinfo; macOS: the FEAT_BF16 sysctl)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        return flags_have_bf16(cpuinfo_flags(cpuinfo.read_text(errors="replace")))
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True,
                                 text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return False
        return out.stdout.strip() == "1"
    return False


# Under autocast every matrix product first casts its operands; on a CPU that costs more than bf16
# saves until the matrices are a few hundred wide (a 64-wide test model trains slower in bf16, the
# 576-wide default model faster: bench/RESULTS.md, ``bench.train_step``).
MIN_CPU_BF16_WIDTH = 512


def effective(precision: str, device: str, width: int | None = None) -> Literal["bf16", "fp32"]:
    """The precision a run on ``device`` uses: an explicit choice as given, ``auto`` as the hardware
    allows (CUDA: what torch reports; CPU: native bf16, for a model at least
    :data:`MIN_CPU_BF16_WIDTH` wide when its hidden ``width`` is known; anything else fp32)."""
    if precision == "bf16":
        return "bf16"
    if precision == "fp32":
        return "fp32"
    if precision != "auto":
        raise ValueError(f"unknown precision {precision!r}: auto, bf16 or fp32")
    kind = device.split(":")[0]
    if kind == "cuda":
        import torch

        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if kind == "cpu":
        wide = width is None or width >= MIN_CPU_BF16_WIDTH
        return "bf16" if wide and cpu_has_bf16() else "fp32"
    return "fp32"
