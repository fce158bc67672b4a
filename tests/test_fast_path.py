"""trainer.precision=auto and model.channels_last=auto follow the hardware found (src/fast_path.py)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from src.fast_path import cpu_bf16_isa, fast_path
from src.trainer import hardware_defaults


def cpu_trainer(**overrides):
    return OmegaConf.create({"accelerator": "cpu", "precision": "auto", "benchmark": "auto", "deterministic": False,
                             **overrides})


def pretend_cpu(monkeypatch, avx512_bf16: bool, amx: bool) -> None:
    """The one stand-in here: the CPU's instruction set, which no test can change for real."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize(("avx512_bf16", "amx", "isa"), [(True, False, "AVX512_BF16"), (True, True, "AMX"),
                                                          (False, True, "AMX")])
def test_a_cpu_with_native_bf16_trains_in_bf16_and_channels_last(monkeypatch, avx512_bf16, amx, isa):
    pretend_cpu(monkeypatch, avx512_bf16, amx)
    chosen = fast_path("cpu")
    assert (chosen.precision, chosen.channels_last) == ("bf16-mixed", True)
    assert isa in chosen.why
    assert hardware_defaults(cpu_trainer()) == {"precision": "bf16-mixed", "benchmark": False}


def test_a_cpu_without_native_bf16_stays_32_bit(monkeypatch):
    pretend_cpu(monkeypatch, False, False)
    chosen = fast_path("cpu")
    assert chosen.precision == "32-true" and "no native bf16" in chosen.why
    assert hardware_defaults(cpu_trainer()) == {"precision": "32-true", "benchmark": False}


def test_a_precision_the_user_set_is_kept(monkeypatch):
    pretend_cpu(monkeypatch, True, False)
    assert hardware_defaults(cpu_trainer(precision="32-true")) == {"benchmark": False}


def test_this_machine_is_read_from_what_torch_reports():
    flags = set(open("/proc/cpuinfo").read().split())
    isa = cpu_bf16_isa()
    assert isa is None or {"AVX512_BF16": "avx512_bf16", "AMX": "amx_tile"}[isa] in flags  # never claimed wrongly
    if "avx512_bf16" in flags:
        assert isa is not None
