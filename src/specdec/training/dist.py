"""Runs across processes (torchrun, accelerate launch, or any launcher that sets RANK and WORLD_SIZE):
which process this is, and the gloo process group they share (CPU; multi-node through MASTER_ADDR)."""

from __future__ import annotations

import os
from datetime import timedelta

from specdec.errors import SpecdecError

# a rank may wait at the final barrier for the slowest one's whole share of the work
TIMEOUT = timedelta(days=7)


def rank_world() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from the launcher's environment; (0, 1) without one."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise SpecdecError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                           "must be integers (set by torchrun or accelerate launch)") from None
    if world < 1 or not 0 <= rank < world:
        raise SpecdecError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return rank, world


def init(world: int) -> None:
    """Join the process group (gloo) when there are several processes."""
    import torch.distributed as dist

    if world == 1 or dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        raise SpecdecError("WORLD_SIZE > 1 without MASTER_ADDR/MASTER_PORT: start the processes with torchrun "
                           "or accelerate launch")
    dist.init_process_group("gloo", timeout=TIMEOUT)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
