"""Which library each GEMM of each :class:`~sampan.layers.linear.Linear` layer runs on,
chosen by measurement on this machine.

On the CPU a linear layer's training step is three GEMMs (forward, input gradient, weight
gradient), and each can run on MKL (PyTorch's default ``addmm`` / ``mm``) or on oneDNN
(:mod:`sampan.layers.linear`). Which one is faster depends on the CPU (oneDNN's fp32 GEMM
uses AVX-512 on AMD EPYC, where MKL keeps to AVX2; on an AVX2-only CPU they are close), on
the shape and on the GEMM (oneDNN's weight gradient pays for a transposed copy), so no fixed
choice is safe. ``train.kernels: auto`` times each GEMM on both libraries, once, at each
layer's real shape (the rows of a training batch, its in and out features), then times the
whole layer (forward + backward) as ``nn.Linear``, on oneDNN and with the faster library per
GEMM, and keeps the fastest when it beats ``nn.Linear`` by :data:`MARGIN` (5 %): for a small
layer the work around the GEMMs outweighs them, and only the whole layer shows it. So a
layer never runs slower than ``nn.Linear`` would, by this machine's own measurement. A layer
of fewer than :data:`MIN_MACS` multiply-adds a step is not timed: it runs as ``nn.Linear``.

Choices are cached in ``$SAMPAN_CACHE_DIR/kernels.json`` (default
``~/.cache/sampan``) under a key made of the CPU model and generation (:func:`cpu_info`),
its ISA flags, the torch version and the thread count. A cached entry is trusted after a
cheap re-check: the largest shape is timed again, and if a cached winner is no longer the
faster one by the measurement's own margin, every shape is measured again. A run keeps its
choice in ``kernels.json`` in the run directory, so a resumed run computes with the same
kernels (bit-exact resume).
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

from sampan import native
from sampan.errors import ConfigError
from sampan.layers.linear import (
    ALL_MKL,
    GEMMS,
    KERNELS,
    Choice,
    Linear,
    forward_gemm,
    input_grad_gemm,
    kernel_name,
    linear,
    onednn_available,
    parse_kernel,
    weight_grad_gemm,
)

Shape = tuple[int, int, int]  # rows, in features, out features
# Layers with fewer multiply-adds a step than this run as nn.Linear without being timed:
# timing a shape costs about half a second, and on the EPYCs measured (AVX2 and AVX-512) no
# library beat MKL on a layer this small; the smallest layer that gained was DIN's output
# layer, 4096 x 400 x 1 (1.6 M), oneDNN in 0.69x nn.Linear's time on an AVX2 EPYC.
MIN_MACS = 1 << 20
# Another library replaces nn.Linear only when its whole layer is this much faster: a gain
# inside the timing's own noise is not worth leaving PyTorch's path for (a layer of DeepFM
# picked oneDNN's input gradient for a 1 % gain on a Zen 3)
MARGIN = 1.05
Timer = Callable[[str, str, Shape], float]  # (kernel, gemm or "layer", shape) -> seconds
Times = dict[str, dict[str, float]]  # gemm or "layer" -> kernel -> seconds, for one shape


GEMM_ISA = ("avx2", "avx512f", "avx512_bf16", "amx_tile")  # the flags that matter for GEMMs


def cpu_info() -> dict[str, Any]:
    """This CPU as ``/proc/cpuinfo`` gives its first processor: ``name`` (the model name,
    with ``family F model M`` when known: a virtual machine's "AMD EPYC" does not say which
    generation), ``family``, ``model`` (ints or None) and ``isa``, the :data:`GEMM_ISA` flags
    it has."""
    name, ident, flags = platform.processor() or platform.machine(), {}, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (x.strip() for x in line.partition(":"))
            if key == "processor" and ident:
                break  # the first processor's lines are enough
            if key == "model name":
                name = value
            elif key in ("cpu family", "model") and value.isdigit():
                ident[key] = int(value)
            elif key == "flags":
                flags = set(value.split())
    except OSError:
        pass
    if ident:
        name += f" family {ident.get('cpu family', '?')} model {ident.get('model', '?')}"
    return {"name": name, "family": ident.get("cpu family"), "model": ident.get("model"),
            "isa": [f for f in GEMM_ISA if f in flags]}


# the variables that cap the ISA of PyTorch's CPU libraries below the CPU's own
# (ATen's kernels, oneDNN, MKL): with avx2 / AVX2 / AVX2 an AVX-512 Intel CPU runs
# PyTorch's CPU path as an AVX2-only one would
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def effective_isa() -> str:
    """The ISA this process's libraries use: ATen's capability as it took effect, and the
    oneDNN and MKL caps the environment sets (none named: the CPU's best)."""
    caps = [f"aten {torch.backends.cpu.get_cpu_capability()}"]
    caps += [f"{name.split('_')[0].lower()} {os.environ[name]}" for name in ISA_CAPS[1:]
             if os.environ.get(name)]
    return ", ".join(caps)


def machine_key(threads: int | None = None) -> str:
    """CPU model and generation, ISA flags that matter for GEMMs, the ISA the libraries
    are held to (:func:`effective_isa`), torch version and thread count."""
    info = cpu_info()
    cpu, isa = info["name"], info["isa"]
    # "per GEMM": the entries' layout (older versions of Sampan keep one time per library
    # under the key without it, and read only that); "C backward": oneDNN's weight
    # gradient reads its transposed copy from the C pass (sampan.native), which changes
    # what it costs against MKL's
    return (f"{cpu} | {' '.join(isa) or 'no-avx2'} | {effective_isa()} | torch "
            f"{torch.__version__} | {threads or torch.get_num_threads()} threads | per GEMM"
            + (" | C backward" if native.library() is not None else ""))


def cache_file() -> Path:
    return native.cache_root() / "kernels.json"


def _operands(shape: Shape) -> tuple[torch.Tensor, ...]:
    """``x [N, K], w [O, K], b [O], g [N, O]`` from a private generator (the training RNG is
    not touched)."""
    n, k, o = shape
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(n, k, generator=gen), torch.randn(o, k, generator=gen),
            torch.zeros(o), torch.randn(n, o, generator=gen))


def _best_of(run: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for i in range(repeats + 1):  # one warm-up call
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        if i:
            best = min(best, dt)
    return best


def time_gemm(kernel: str, gemm: str, shape: Shape, repeats: int = 1) -> float:
    """Seconds for one of a layer's GEMMs (see :data:`~sampan.layers.linear.GEMMS`) on
    ``kernel``'s library, with what it needs beyond the GEMM (a transposed copy): the best
    of ``repeats``, after a warm-up call. ``gemm="layer"`` times the whole layer with
    ``kernel`` (a
    :func:`~sampan.layers.linear.parse_kernel` spec, see :func:`time_layer`)."""
    if gemm == "layer":
        return time_layer(kernel, shape, repeats)
    x, w, b, g = _operands(shape)
    run = {"forward": lambda: forward_gemm(kernel, x, w, b),
           "input_grad": lambda: input_grad_gemm(kernel, g, w),
           "weight_grad": lambda: weight_grad_gemm(kernel, g, x)}[gemm]
    return _best_of(run, repeats)


def time_layer(kernel: str, shape: Shape, repeats: int = 5) -> float:
    """Seconds for a whole layer's forward + backward (the best of ``repeats``) with
    ``kernel`` (see :func:`~sampan.layers.linear.parse_kernel`; ``"mkl"`` is exactly
    ``nn.Linear``)."""
    x, w, b, up = _operands(shape)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    choice = parse_kernel(kernel)
    forward = (lambda: F.linear(x, w, b)) if choice == ALL_MKL else \
        (lambda: linear(x, w, b, choice))

    def run() -> None:
        forward().backward(up)
        x.grad = w.grad = b.grad = None

    return _best_of(run, repeats)


def measure(shape: Shape, timer: Timer = time_gemm, rounds: int = 4) -> Times:
    """Every GEMM of ``shape`` on every library, then the whole layer (``"layer"``) as
    ``nn.Linear`` (``mkl``), on oneDNN and with the faster library per GEMM: the best of
    ``rounds`` timings each, interleaved call by call, so that a machine whose speed drifts
    meanwhile (a shared host's can, by 20 % within seconds) slows every candidate alike and
    the best of each is its unhindered time. The whole layer is what decides (:func:`best`):
    a small layer's GEMMs take less time than the work around them, which the per-GEMM times
    do not see."""
    times: Times = {gm: dict.fromkeys(KERNELS, float("inf")) for gm in GEMMS}
    for _ in range(rounds):
        for gm in GEMMS:
            for k in KERNELS:
                times[gm][k] = min(times[gm][k], timer(k, gm, shape))
    times["layer"] = dict.fromkeys((kernel_name(fastest(times)), *KERNELS), float("inf"))
    for _ in range(rounds):
        for k in times["layer"]:
            times["layer"][k] = min(times["layer"][k], timer(k, "layer", shape))
    return times


def fastest(times: Times) -> Choice:
    """The faster library of each GEMM (MKL on a tie)."""
    pick = [min(KERNELS, key=lambda k, gm=gm: (times[gm][k], k != "mkl")) for gm in GEMMS]
    return (pick[0], pick[1], pick[2])


def best(times: Times) -> str:
    """The kernel (a :func:`~sampan.layers.linear.parse_kernel` spec) whose whole layer was
    fastest, when it beats ``mkl`` (exactly ``nn.Linear``) by :data:`MARGIN`; else ``mkl``."""
    layer = times["layer"]
    fast = min(layer, key=lambda k: (layer[k], k != "mkl"))
    return fast if layer["mkl"] >= MARGIN * layer[fast] else "mkl"


def layer_time(times: Times, choice: Choice) -> float:
    """A layer's three GEMMs with ``choice``, in seconds."""
    return sum(times[gm][k] for gm, k in zip(GEMMS, choice, strict=True))


@dataclass
class KernelPlan:
    """The kernel of every layer (by module name), and how it was decided."""

    mode: str
    layers: dict[str, str] = field(default_factory=dict)  # name -> kernel (parse_kernel)
    shapes: dict[str, Shape] = field(default_factory=dict)
    times: dict[str, Times] = field(default_factory=dict)  # "NxKxO" -> gemm -> kernel -> s
    source: str = ""  # measured / cached / forced / run

    def describe(self) -> str:
        if not self.layers:
            return ("no sampan.layers.Linear on the CPU: nothing to choose (torch.nn.Linear "
                    "runs on PyTorch's own GEMM)")
        count: dict[str, int] = {}
        for k in self.layers.values():
            count[k] = count.get(k, 0) + 1
        picked = ", ".join(f"{k} for {n} layer(s)" for k, n in sorted(count.items()))
        if self.mode != "auto":
            return f"{picked} (train.kernels={self.mode})"
        gains = [f"{s} {best(t)} {t['layer']['mkl'] / t['layer'][best(t)]:.2f}x"
                 for s, t in self.times.items() if "layer" in t]
        if not gains:
            return f"{picked} ({self.source})"
        small = sum(_key(s) not in self.times for s in self.shapes.values())
        rest = f"; {small} smaller layer(s) untimed, as nn.Linear" if small else ""
        return (f"{picked} ({self.source}, time of nn.Linear / chosen: {'; '.join(gains)}"
                f"{rest})")

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "layers": self.layers, "source": self.source,
                "shapes": {k: list(v) for k, v in self.shapes.items()}, "times": self.times,
                "gemms": list(GEMMS)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KernelPlan:
        # a run saved before kernels were chosen per GEMM names one library per layer,
        # which parse_kernel reads as that library for all three
        times = {k: t for k, t in d.get("times", {}).items() if _valid(t)}
        return cls(d["mode"], dict(d["layers"]), {k: tuple(v) for k, v in d["shapes"].items()},
                   times, "run")


def _key(shape: Shape) -> str:
    return "x".join(map(str, shape))


def _valid(entry: Any) -> bool:
    """A cache entry of per-GEMM and whole-layer times (older caches held one time per
    library)."""
    return isinstance(entry, dict) and isinstance(entry.get("layer"), dict) and all(
        isinstance(entry.get(gm), dict) and set(entry[gm]) >= set(KERNELS) for gm in GEMMS)


def choose(shapes: Iterable[Shape], timer: Timer = time_gemm, cache: Path | None = None,
           machine: str | None = None) -> tuple[dict[str, str], dict[str, Times], str]:
    """The fastest kernel of each shape (``"NxKxO" -> kernel``, see :func:`best`), the times,
    and whether they were ``measured`` or ``cached`` (cached entries re-checked on the
    largest shape)."""
    shapes = sorted(set(shapes), key=lambda s: -s[0] * s[1] * s[2])
    cache = cache or cache_file()
    machine = machine or machine_key()
    try:
        stored = json.loads(cache.read_text())
    except (OSError, ValueError):
        stored = {}
    entry: dict[str, Times] = {k: v for k, v in stored.get(machine, {}).items() if _valid(v)}
    source = "cached"
    if shapes and all(_key(s) in entry for s in shapes):
        top = shapes[0]
        was = entry[_key(top)]
        now = dict.fromkeys(was["layer"], float("inf"))  # the cached candidates, whole
        for _ in range(2):
            for k in now:
                now[k] = min(now[k], timer(k, "layer", top))
        if now[best(was)] > MARGIN * min(now.values()):  # the cached choice, as best() picks
            # the cached choice now loses by more than the measurement's own margin: the
            # machine no longer behaves as recorded, so measure everything
            entry = {}
    missing = [s for s in shapes if _key(s) not in entry]
    if missing:
        source = "measured"
        for s in missing:
            entry[_key(s)] = measure(s, timer)
        stored[machine] = entry
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(stored, indent=1))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home: measured again next time
    times = {_key(s): entry[_key(s)] for s in shapes}
    return {s: best(t) for s, t in times.items()}, times, source


def layer_shapes(model: nn.Module, probe: Callable[[], Any]) -> dict[str, Shape]:
    """``(rows, in, out)`` of every CPU :class:`Linear` in ``model``, recorded from one
    ``probe()`` forward (run in eval mode without gradients; RNG state restored)."""
    shapes: dict[str, Shape] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.weight.device.type == "cpu":
            def hook(mod: nn.Module, args: tuple, _out: Any, name: str = name) -> None:
                x = args[0]
                # in features from the input: a caller may pass a weight of its own
                shapes[name] = (x.numel() // x.shape[-1], x.shape[-1], mod.out_features)
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
                 timer: Timer = time_gemm, cache: Path | None = None) -> KernelPlan:
    """Decide every layer's kernel (``mode``: auto, mkl or onednn) and apply it."""
    if mode == "onednn" and not onednn_available():
        raise ConfigError("train.kernels=onednn, but this torch build cannot run oneDNN "
                         "GEMMs; use auto or mkl")
    shapes = layer_shapes(model, probe)
    plan = KernelPlan(mode, shapes=shapes)
    if mode == "auto" and not onednn_available():
        mode, plan.source = "mkl", "oneDNN unavailable"
    if mode == "auto":
        timed = [s for s in shapes.values() if s[0] * s[1] * s[2] >= MIN_MACS]
        plan.source = "all layers too small to time: nn.Linear"
        chosen: dict[str, str] = {}
        if timed:
            chosen, plan.times, plan.source = choose(timed, timer, cache)
        plan.layers = {n: chosen.get(_key(s), "mkl") for n, s in shapes.items()}
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
