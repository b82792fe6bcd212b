"""Data-parallel training under ``torchrun``: one process per device, each with its share of every step.

Every rank draws the same global batch (same generator), packs and runs its share of the sequences, and
scales its loss so that the ranks' gradients, averaged by PyTorch DDP, are the one-process gradient of the
whole batch. Rank 0 evaluates, writes the log, checkpoints and exports; the feature cache's shards are
split between the ranks (``shard i`` on rank ``i % world``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from ddtree.runtime.distributed import before_process_group

# Building a feature cache can keep one rank at a barrier for as long as the slowest rank's share takes.
GROUP_TIMEOUT = datetime.timedelta(hours=12)


@dataclass
class DataParallel:
    """This process's place among the training ranks (one rank, inactive, outside ``torchrun``)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    started: bool = False  # this object created the process group (so stop() destroys it)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> DataParallel:
        """The ranks ``torchrun`` describes in ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` (or an existing group)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))

    def start(self, device: str) -> None:
        """Join the process group (NCCL for CUDA devices, gloo for the CPU) unless one exists."""
        import torch.distributed as dist

        if not self.active or dist.is_initialized():
            return
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(torch.device(device))
        before_process_group()
        dist.init_process_group("nccl" if cuda else "gloo", timeout=GROUP_TIMEOUT)
        self.started = True

    def stop(self) -> None:
        """Leave the group this object started, after a barrier so the ranks leave together."""
        import torch.distributed as dist

        if self.started and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            self.started = False

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (``t`` itself on one rank)."""
        if not self.active:
            return t
        import torch.distributed as dist

        t = t.clone()
        dist.all_reduce(t)
        return t

    def share(self, obj):
        """Rank 0's ``obj`` on every rank (small, picklable)."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share_of(self, items: list) -> list:
        """This rank's share of ``items``: every ``world``-th, from its rank."""
        return list(items[self.rank::self.world])

    def wrap(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """``module`` in PyTorch DDP when there are several ranks (gradients averaged over them in backward)."""
        if not self.active:
            return module
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
