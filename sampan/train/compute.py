"""How the dense layers compute in a run: their precision (bf16 autocast where the hardware
multiplies bf16 natively), each linear layer's CPU GEMM path, measured once and kept with the
run (see :mod:`sampan.layers.kernels`), ``torch.compile``, the dense optimizer, and the
process's memory allocator on the CPU."""

from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from sampan.data.loader import BatchLoader
from sampan.embedding import EmbeddingCollection
from sampan.layers import MLP
from sampan.layers.kernels import KernelPlan, cpu_info, plan_kernels
from sampan.layers.kernels import apply as apply_kernels

if TYPE_CHECKING:
    from sampan.config import TrainConfig
    from sampan.train.trainer import Trainer


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) under which it still multiplies bf16 natively
_BF16_ONEDNN = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                "AVX10_2_512_AMX_2", "ALL", "DEFAULT")


def bf16_hardware(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` multiplies bf16 matrices natively, and what says so: a GPU that
    supports bf16, or a CPU with AMX-BF16 or AVX512-BF16 whose oneDNN is not held below it
    (``ONEDNN_MAX_CPU_ISA``). Elsewhere bf16 is emulated in fp32 and slower than fp32."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        name = torch.cuda.get_device_name(device)
        return ok, f"{name} {'supports' if ok else 'does not support'} bf16"
    if device.type != "cpu":
        return False, f"{device.type} devices train in fp32"
    flags = set(cpu_info()["isa"])
    native = [f for f in ("amx_tile", "avx512_bf16") if f in flags]
    if not native:
        return False, "this CPU has neither AMX nor AVX512-BF16"
    what = "AMX" if "amx_tile" in native else "AVX512-BF16"
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and cap not in _BF16_ONEDNN:
        return False, f"this CPU has {what}, but ONEDNN_MAX_CPU_ISA={cap} holds oneDNN below it"
    try:
        usable = torch.backends.mkldnn.is_available() and \
            bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the probe
        usable = False
    if not usable:
        return False, f"this CPU has {what}, but this torch build's oneDNN cannot use it"
    return True, f"this CPU has {what}"


def resolve_amp(setting: str, device: torch.device, model: nn.Module) -> tuple[str, str]:
    """``train.amp`` -> (``"bf16"`` or ``"none"``, why). ``auto`` is bf16 on hardware that
    multiplies bf16 natively (:func:`bf16_hardware`) unless the model says it trains worse in
    bf16 (a class attribute ``amp_auto = "none"`` with ``amp_why``); fp32 elsewhere."""
    if setting != "auto":
        return setting, f"{setting} (set)"
    ok, hardware = bf16_hardware(device)
    if not ok:
        return "none", f"fp32: {hardware}"
    model = getattr(model, "module", model)  # a data-parallel wrapper's model
    if getattr(model, "amp_auto", "bf16") == "none":
        why = getattr(model, "amp_why", "this model trains worse in bf16")
        return "none", f"fp32: {hardware}, but {why}"
    return "bf16", (f"bf16 autocast with fp32 weights and optimizer state: {hardware}; "
                    "evaluated in fp32, as served")


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


@functools.cache
def reuse_freed_memory() -> str:
    """Keep the memory a training step frees in the process for the next step's tensors
    (``train.reuse_memory``); what was done, or why not ("" where there is nothing to do).

    glibc's malloc serves each block over its mmap threshold (128 KB, raised up to 32 MB as
    large blocks are freed) with a fresh mapping and hands it back on free, and trims freed
    memory off the top of its heap: a step's activations, several MB each, are then faulted
    in again, page by page, every step (measured at batch 4096: 16,000 page faults a DCNv2
    step, 140,000 to 230,000 a DIN step, whose attention activations are 65 MB). With no
    mapping of its own for any block and no trimming, freed blocks are reused instead; the
    process keeps its peak memory until it exits. Set once for the whole process (Linux
    with glibc; a thread's arena still maps what its heap cannot hold)."""
    if not sys.platform.startswith("linux"):
        return ""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version  # glibc's own: not in musl
        version.restype = ctypes.c_char_p
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return ""
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        return f"glibc {version().decode()} refused the malloc settings: its defaults stay"
    return ("on: a step's freed memory serves the next step (glibc malloc keeps every block "
            "in its heap) instead of being faulted in again")


def apply_saved(model: nn.Module, run_dir: Path) -> KernelPlan | None:
    """The kernels a run measured (``kernels.json``), applied to ``model``; None without."""
    saved = run_dir / "kernels.json"
    if not saved.exists():
        return None
    plan = KernelPlan.from_json(json.loads(saved.read_text()))
    apply_kernels(model, plan)
    return plan


def plan_for(trainer: Trainer, measure: bool) -> KernelPlan | None:
    """Each linear layer's CPU GEMM path (see :mod:`sampan.layers.kernels`): the run's
    own choice when it has one (a resumed run computes as before), else measured on a
    training batch (rank 0 decides for every process) and saved with the run."""
    if trainer.device.type != "cpu":
        return None
    if (plan := apply_saved(trainer.model, trainer.run_dir)) is not None:
        return plan
    saved = trainer.run_dir / "kernels.json"
    if not measure or not len(trainer.train_data):
        return None
    rows = min(trainer.tc.batch_size // trainer.strategy.world, len(trainer.train_data))
    batch = next(iter(BatchLoader(trainer.train_data.take(np.arange(rows)), rows,
                                  shuffle="none", prefetch=0)))
    plan = plan_kernels(trainer.model, trainer.tc.kernels,
                        lambda: trainer.task.loss(trainer.model, batch))
    if trainer.strategy.enabled:  # every process computes with rank 0's choice
        plan = KernelPlan.from_json(trainer.strategy.broadcast(plan.to_json()))
        apply_kernels(trainer.model, plan)
    if trainer.strategy.is_main:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(plan.to_json(), indent=1))
    return plan


# ATen's CPU capability (ATEN_CPU_CAPABILITY) -> the -march that compiles code for it
_MARCH_OF_CAPABILITY = {"avx2": "x86-64-v3", "default": "x86-64"}


def compiled_march() -> str | None:
    """The ``-march`` compiled CPU kernels need when ``ATEN_CPU_CAPABILITY`` holds ATen
    below the CPU (``avx2`` on an AVX-512 CPU), or None. The compiler otherwise builds them
    with ``-march=native``, and that code, mixed with ATen's AVX2 kernels, gave non-finite
    values within 15 steps of DIN training (an AMD EPYC family 25 model 17 and an Intel
    family 6 model 167, both AVX-512; an AVX2-only CPU trains it)."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    return _MARCH_OF_CAPABILITY.get(cap) if platform.machine() in ("x86_64", "AMD64") else None


def compile_dense(model: nn.Module) -> None:
    """``torch.compile`` every child module that holds no embedding table, in place (so
    state_dict keys do not change). The lookup (``torch.unique``, data-dependent shapes)
    stays eager, and so does an MLP whose every activation is a ReLU fused into its layer's
    GEMM: it has nothing for the compiler to fuse, and eager it keeps the GEMM libraries
    measured for it (a compiled graph uses ``F.linear``). CPU kernels are built for the ISA
    ATen is held to, if it is (:func:`compiled_march`), unless inductor's own ``march`` is
    set."""
    march = compiled_march()
    if march is not None:
        from torch._inductor import config as inductor

        if inductor.cpp.march is None:
            inductor.cpp.march = march
    for child in model.children():
        if any(isinstance(m, EmbeddingCollection) for m in child.modules()):
            compile_dense(child)
        elif isinstance(child, MLP) and child.fused:
            continue
        elif any(True for _ in child.parameters()):
            child.compile(dynamic=False)


def fused_optimizer_on(params: list[torch.Tensor]) -> bool:
    """Whether this torch has fused Adam / AdamW / SGD kernels for ``params`` (floating point,
    all on one device type that has them: the CPU since torch 2.4)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:
        return False
    kinds = {p.device.type for p in params}
    return len(kinds) == 1 and kinds <= devices and all(p.is_floating_point() for p in params)


def dense_optimizer(params: list[torch.Tensor], tc: TrainConfig) -> torch.optim.Optimizer | None:
    """``train.optimizer`` over the dense parameters (None without any): one fused kernel
    for all of them where this torch has it (4.5 -> 0.9 ms a step for DCNv2's 1 M dense
    parameters on 2 CPU cores).

    A parameter with an ``lr_multiplier`` attribute (e.g. FwFM's field-pair weights) learns at
    that multiple of ``train.lr``, in a parameter group of its own; the schedule scales every
    group alike."""
    if not params:
        return None
    opts = {"fused": True} if fused_optimizer_on(params) else {}
    by_rate: dict[float, list[torch.Tensor]] = {}
    for p in params:
        by_rate.setdefault(float(getattr(p, "lr_multiplier", 1.0)), []).append(p)
    groups = [{"params": ps, "lr": tc.lr * m} for m, ps in by_rate.items()]
    if tc.optimizer == "adam":
        return torch.optim.Adam(groups, lr=tc.lr, weight_decay=tc.weight_decay, **opts)
    if tc.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay, **opts)
    return torch.optim.SGD(groups, lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay,
                           **opts)


def l1_shrink_targets(opt: torch.optim.Optimizer | None) -> list[tuple[int, torch.Tensor, float]]:
    """``(group index, parameter, l1)`` for each parameter of ``opt`` with an ``l1_shrink``
    attribute (FwFM's field-pair weights): what :func:`shrink_l1` moves after each step. The
    group is kept by index: loading a checkpoint replaces the group dicts."""
    if opt is None:
        return []
    return [(i, p, float(p.l1_shrink)) for i, g in enumerate(opt.param_groups)
            for p in g["params"] if getattr(p, "l1_shrink", 0.0) > 0]


@torch.no_grad()
def shrink_l1(opt: torch.optim.Optimizer, targets: list[tuple[int, torch.Tensor, float]]) -> None:
    """The proximal step of an L1 penalty: each target moves toward 0 by ``l1`` times its
    group's current learning rate, and a value that would cross 0 stops at 0.

    >>> p = torch.nn.Parameter(torch.tensor([1.0, -0.005, 0.0]))
    >>> p.l1_shrink = 0.5
    >>> opt = torch.optim.SGD([p], lr=0.02)
    >>> shrink_l1(opt, l1_shrink_targets(opt)); p.data.tolist()
    [0.9900000095367432, 0.0, 0.0]
    """
    for i, p, l1 in targets:
        step = opt.param_groups[i]["lr"] * l1
        p.sub_(p.clamp(-step, step))  # = sign(p) * max(|p| - step, 0)
