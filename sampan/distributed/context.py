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
    backend = "gloo"
    if device_type == "cuda":
        gpus = torch.cuda.device_count()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        # one GPU per process; more processes than GPUs share them in turn, over gloo (NCCL
        # refuses two ranks on one GPU)
        torch.cuda.set_device(local_rank % max(gpus, 1))
        backend = "nccl" if local_world <= gpus else "gloo"
        if backend == "gloo" and local_rank == 0:
            print(f"{local_world} processes on {gpus} GPU(s): they share GPUs, so the "
                  "collectives go over gloo (NCCL needs one GPU per process)", flush=True)
    if not dist.is_initialized():
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


def shutdown(failed: bool = False) -> None:
    """Leave the process group. After a success, every rank waits for the others first (no
    rank tears its connections down while a peer still uses them); a rank that failed
    leaves at once: its peers may be waiting in another collective that it will never
    join, and the launcher stops them when this rank exits."""
    global _CTX
    if dist.is_initialized():
        if not failed:
            dist.barrier()
        dist.destroy_process_group()
    _CTX = DistContext()
