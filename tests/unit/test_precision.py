"""train.amp: auto is bf16 exactly where the hardware multiplies bf16 natively and the model
does not opt out, fp32 elsewhere, and says why; evaluation is fp32 whatever trained."""

import pytest
import torch
from torch import nn

import sampan.train.compute as compute
from sampan.train.compute import bf16_hardware, resolve_amp

CPU = torch.device("cpu")


def with_flags(monkeypatch, flags):
    monkeypatch.setattr(compute, "cpu_info", lambda: {"name": "test CPU", "isa": flags})


def test_a_cpu_without_amx_or_avx512_bf16_trains_in_fp32(monkeypatch):
    with_flags(monkeypatch, ["avx2", "avx512f"])
    assert bf16_hardware(CPU) == (False, "this CPU has neither AMX nor AVX512-BF16")
    amp, why = resolve_amp("auto", CPU, nn.Linear(2, 2))
    assert amp == "none" and why.startswith("fp32: this CPU has neither")


def test_onednn_held_below_bf16_trains_in_fp32(monkeypatch):
    with_flags(monkeypatch, ["avx2", "avx512f", "avx512_bf16", "amx_tile"])
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    ok, why = bf16_hardware(CPU)
    assert not ok and "AMX" in why and "ONEDNN_MAX_CPU_ISA=AVX2" in why


def test_auto_is_bf16_on_bf16_hardware_unless_the_model_opts_out(monkeypatch):
    monkeypatch.setattr(compute, "bf16_hardware", lambda device: (True, "this CPU has AMX"))
    amp, why = resolve_amp("auto", CPU, nn.Linear(2, 2))
    assert amp == "bf16" and "this CPU has AMX" in why and "fp32" in why

    class Careful(nn.Linear):
        amp_auto, amp_why = "none", "its attention softmax loses AUC in bf16"

    amp, why = resolve_amp("auto", CPU, Careful(2, 2))
    assert amp == "none" and "its attention softmax loses AUC in bf16" in why


@pytest.mark.parametrize("setting", ["none", "bf16"])
def test_a_set_precision_is_kept_whatever_the_hardware(monkeypatch, setting):
    monkeypatch.setattr(compute, "bf16_hardware", lambda device: (False, "no"))
    assert resolve_amp(setting, CPU, nn.Linear(2, 2)) == (setting, f"{setting} (set)")


def test_this_machine_agrees_with_its_flags():
    flags = set(compute.cpu_info()["isa"])
    ok, _ = bf16_hardware(CPU)
    assert ok == (bool(flags & {"amx_tile", "avx512_bf16"})
                  and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                  and compute.os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
                  in compute._BF16_ONEDNN)


@pytest.mark.parametrize("cap, march", [("avx2", "x86-64-v3"), ("AVX2", "x86-64-v3"),
                                        ("default", "x86-64"), ("avx512", None), ("", None)])
def test_compiled_kernels_follow_the_isa_aten_is_held_to(monkeypatch, cap, march):
    """With ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU, torch.compile's CPU kernels built
    with -march=native gave DIN non-finite values; they are built for the capped ISA."""
    import platform

    from torch._inductor import config as inductor

    from sampan.train.compute import compile_dense, compiled_march

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    assert compiled_march() == march
    monkeypatch.setattr(inductor.cpp, "march", None)
    compile_dense(torch.nn.Sequential())  # nothing to compile: sets the march alone
    assert inductor.cpp.march == march
    monkeypatch.setattr(inductor.cpp, "march", "znver4")  # the user's own is kept
    compile_dense(torch.nn.Sequential())
    assert inductor.cpp.march == "znver4"
