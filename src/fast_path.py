"""What ``trainer.precision=auto`` and ``model.channels_last=auto`` become on the hardware found.

The choice follows what the machine reports, never a guess about which machine this is:

- a CUDA GPU: bf16 autocast where it has bf16 (Ampere and later), channels-last (tensor cores run
  convolutions in NHWC);
- a CPU with native bf16 instructions (AVX512_BF16 or AMX, as torch reports them): bf16 autocast and
  channels-last. oneDNN then runs bf16 convolutions in hardware: 2.4x the fp32 rate of a ResNet-50
  train step on an AVX512_BF16 AMD EPYC (README, "CPU fast path");
- any other CPU: 32-bit, as bf16 autocast is emulated there (a ResNet-50 train step ran at a tenth of
  the fp32 rate on an AVX2 AMD EPYC), but channels-last, which oneDNN runs faster in fp32 too.

``benchmarks/cpu_fast_path.py`` measures every combination on the machine at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FastPath:
    precision: str        # a Lightning precision
    channels_last: bool
    why: str              # one clause for the run line

    @property
    def label(self) -> str:
        """'bf16-mixed, channels-last': how the run lines, benchmarks and reports name this choice."""
        return f"{self.precision}, {'channels-last' if self.channels_last else 'contiguous'}"


def cpu_bf16_isa() -> str | None:
    """'AMX' or 'AVX512_BF16' where the CPU computes in bf16 natively, else None."""
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512_BF16"
    return None


def cpu_capability() -> str:
    """The widest vector ISA torch's CPU kernels use here: 'AVX2', 'AVX512', ..."""
    return torch.backends.cpu.get_cpu_capability()


def fast_path(device_type: str) -> FastPath:
    """The precision and memory format ``auto`` resolves to on a device of ``device_type`` in this process."""
    if device_type == "cuda":
        if torch.cuda.is_bf16_supported():
            return FastPath("bf16-mixed", True, "the GPU has bf16")
        return FastPath("32-true", True, "the GPU has no bf16: 32-bit with TF32 matmuls")
    if device_type == "cpu":
        isa = cpu_bf16_isa()
        if isa is not None:
            return FastPath("bf16-mixed", True, f"the CPU has native bf16 ({isa})")
        return FastPath("32-true", True, f"the CPU has no native bf16 ({cpu_capability()}): bf16 would be emulated")
    return FastPath("32-true", False, f"no fast path known for {device_type}")
