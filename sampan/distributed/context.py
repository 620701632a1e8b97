"""The process group: who this process is (rank, world), started from the launcher's
environment, and shut down with it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


_CTX = DistContext()


def context() -> DistContext:
    """The process's place in the job (rank 0 of 1 outside a distributed launch)."""
    return _CTX


def init_from_env(device_type: str = "cpu") -> DistContext:
    """Join the process group described by torchrun's environment (``WORLD_SIZE`` > 1)."""
    global _CTX
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        _CTX = DistContext()
        return _CTX
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_launcher()
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)  # one GPU per process on each machine
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    _CTX = DistContext(rank=dist.get_rank(), world=dist.get_world_size(),
                       local_rank=local_rank)
    return _CTX


def _die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a launcher killed outright
    (SIGKILL to ``sampan train``'s process group) would leave its ranks training on. On
    Linux, have the kernel kill this rank when its launcher dies."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


def shutdown() -> None:
    global _CTX
    if dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while a peer still uses them
        dist.destroy_process_group()
    _CTX = DistContext()
