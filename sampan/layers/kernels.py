"""Which GEMM path each :class:`~sampan.layers.linear.Linear` layer runs, chosen by
measurement on this machine.

On the CPU a linear layer can run its three GEMMs (forward, input gradient, weight gradient)
on MKL (``torch.nn.functional.linear``, PyTorch's default) or on oneDNN
(:mod:`sampan.layers.linear`). Which one is faster depends on the CPU (oneDNN's fp32 GEMM
uses AVX-512 on AMD EPYC, where MKL keeps to AVX2; on an AVX2-only CPU MKL can win) and on
the shape, so neither is a safe default. ``train.kernels: auto`` times both, once, at each
layer's real shape (the rows of a training batch, its in and out features), forward and
backward, and gives every layer the faster one.

Choices are cached in ``$SAMPAN_CACHE_DIR/kernels.json`` (default
``~/.cache/sampan``) under a key made of the CPU model, its ISA flags, the torch version and
the thread count. A cached entry is trusted after a cheap re-check: the largest shape is
timed again, and if the cached winner is no longer the faster one by the measurement's own
margin, every shape is measured again. A run keeps its choice in ``kernels.json`` in the run
directory, so a resumed run computes with the same kernels (bit-exact resume).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sampan.errors import ConfigError
from sampan.layers.linear import Linear, _onednn_linear, onednn_available

KERNELS = ("mkl", "onednn")
Shape = tuple[int, int, int]  # rows, in features, out features
Timer = Callable[[str, Shape], float]


def machine_key(threads: int | None = None) -> str:
    """CPU model, ISA flags that matter for GEMMs, torch version and thread count."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return (f"{cpu} | {' '.join(isa) or 'no-avx2'} | torch {torch.__version__} | "
            f"{threads or torch.get_num_threads()} threads")


def cache_file() -> Path:
    root = os.environ.get("SAMPAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sampan")
    return Path(root) / "kernels.json"


def time_linear(kernel: str, shape: Shape, repeats: int = 5) -> float:
    """Seconds for forward + both backward GEMMs of one layer (the best of ``repeats``),
    on inputs from a private generator (the training RNG is not touched)."""
    n, k, o = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, k, generator=g, requires_grad=True)
    w = torch.randn(o, k, generator=g, requires_grad=True)
    b = torch.zeros(o, requires_grad=True)
    up = torch.randn(n, o, generator=g)
    run = (lambda: F.linear(x, w, b)) if kernel == "mkl" else (lambda: _onednn_linear(x, w, b))
    best = float("inf")
    for i in range(repeats + 2):  # two warm-up calls
        t0 = time.perf_counter()
        run().backward(up)
        dt = time.perf_counter() - t0
        if i >= 2:
            best = min(best, dt)
        x.grad = w.grad = b.grad = None
    return best


@dataclass
class KernelPlan:
    """The kernel of every layer (by module name), and how it was decided."""

    mode: str
    layers: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, Shape] = field(default_factory=dict)
    times: dict[str, dict[str, float]] = field(default_factory=dict)  # "NxKxO" -> kernel: s
    source: str = ""  # measured / cached / forced / run

    def describe(self) -> str:
        if not self.layers:
            return "no linear layers on the CPU: nothing to choose"
        count = {k: sum(v == k for v in self.layers.values()) for k in KERNELS}
        picked = ", ".join(f"{k} for {n} layer(s)" for k, n in count.items() if n)
        if self.mode != "auto":
            return f"{picked} (train.kernels={self.mode})"
        gains = []
        for s, t in self.times.items():
            fast, slow = sorted(t.values())
            gains.append(f"{s} {min(t, key=t.get)} {slow / fast:.2f}x")
        return f"{picked} ({self.source}: {'; '.join(gains)})"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "layers": self.layers, "source": self.source,
                "shapes": {k: list(v) for k, v in self.shapes.items()}, "times": self.times}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KernelPlan:
        return cls(d["mode"], dict(d["layers"]), {k: tuple(v) for k, v in d["shapes"].items()},
                   d.get("times", {}), "run")


def _key(shape: Shape) -> str:
    return "x".join(map(str, shape))


def choose(shapes: Iterable[Shape], timer: Timer = time_linear, cache: Path | None = None,
           machine: str | None = None) -> tuple[dict[str, str], dict[str, dict[str, float]],
                                                 str]:
    """The faster kernel for each shape (``"NxKxO" -> kernel``), the times, and whether they
    were ``measured`` or ``cached`` (cached entries re-checked on the largest shape)."""
    shapes = sorted(set(shapes), key=lambda s: -s[0] * s[1] * s[2])
    cache = cache or cache_file()
    machine = machine or machine_key()
    try:
        stored = json.loads(cache.read_text())
    except (OSError, ValueError):
        stored = {}
    entry: dict[str, dict[str, float]] = stored.get(machine, {})
    source = "cached"
    if shapes and all(_key(s) in entry for s in shapes):
        top = shapes[0]
        now = {k: timer(k, top) for k in KERNELS}
        was = entry[_key(top)]
        if min(now, key=now.get) != min(was, key=was.get) and \
                abs(now["mkl"] - now["onednn"]) > 0.05 * min(now.values()):
            entry = {}  # the machine no longer behaves as recorded: measure everything
    missing = [s for s in shapes if _key(s) not in entry]
    if missing:
        source = "measured"
        for s in missing:
            entry[_key(s)] = {k: timer(k, s) for k in KERNELS}
        stored[machine] = entry
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(stored, indent=1))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home: measured again next time
    times = {_key(s): entry[_key(s)] for s in shapes}
    return {s: min(t, key=t.get) for s, t in times.items()}, times, source


def layer_shapes(model: nn.Module, probe: Callable[[], Any]) -> dict[str, Shape]:
    """``(rows, in, out)`` of every CPU :class:`Linear` in ``model``, recorded from one
    ``probe()`` forward (run in eval mode without gradients; RNG state restored)."""
    shapes: dict[str, Shape] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.weight.device.type == "cpu":
            def hook(mod: nn.Module, args: tuple, _out: Any, name: str = name) -> None:
                x = args[0]
                shapes[name] = (x.numel() // x.shape[-1], mod.in_features, mod.out_features)
            hooks.append(m.register_forward_hook(hook))
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            probe()
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return shapes


def plan_kernels(model: nn.Module, mode: str, probe: Callable[[], Any],
                 timer: Timer = time_linear, cache: Path | None = None) -> KernelPlan:
    """Decide every layer's kernel (``mode``: auto, mkl or onednn) and apply it."""
    if mode == "onednn" and not onednn_available():
        raise ConfigError("train.kernels=onednn, but this torch build cannot run oneDNN "
                         "GEMMs; use auto or mkl")
    shapes = layer_shapes(model, probe)
    plan = KernelPlan(mode, shapes=shapes)
    if mode == "auto" and not onednn_available():
        mode, plan.source = "mkl", "oneDNN unavailable"
    if mode == "auto" and shapes:
        best, plan.times, plan.source = choose(shapes.values(), timer, cache)
        plan.layers = {n: best[_key(s)] for n, s in shapes.items()}
    else:
        plan.layers = {n: mode for n in shapes}
    apply(model, plan)
    return plan


def apply(model: nn.Module, plan: KernelPlan) -> None:
    """Give each named layer its kernel."""
    modules = dict(model.named_modules())
    for name, kernel in plan.layers.items():
        if isinstance(modules.get(name), Linear):
            modules[name].kernel = kernel
