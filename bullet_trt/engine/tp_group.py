"""One process's membership in a group of tensor-parallel ranks: torch.distributed, initialised
from the environment (MASTER_ADDR / MASTER_PORT, RANK, WORLD_SIZE), one process per rank,
rank r on cuda:r (gloo on CPU, NCCL on GPUs).

Two process groups: the default one carries the model's collectives (NCCL on GPUs), and a gloo
group carries the small Python objects rank 0 hands the others (which batch to run, which KV
blocks it gave out), so that a follower waiting for its next step waits on a socket, not on a
GPU kernel.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

from bullet_trt.model.tensor_parallel import Shard

# NVLink multicast (NVLS) stays off: the shared machines do not allow it, and NCCL and
# torch's symmetric memory would otherwise try it on NVSwitch systems.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# A follower waits for rank 0's next message for as long as the server is idle; gloo would
# otherwise end the wait after its default 30 minutes with an error.
IDLE_LIMIT = timedelta(days=3650)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet (torch.distributed's env:// initialisation)."""

    size: int
    addr: str = "127.0.0.1"
    port: int = 0

    @classmethod
    def new(cls, size: int) -> "Rendezvous":
        return cls(size, "127.0.0.1", free_port())

    def env(self, rank: int) -> dict[str, str]:
        return {"MASTER_ADDR": self.addr, "MASTER_PORT": str(self.port), "RANK": str(rank),
                "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.size), **NO_MULTICAST}


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:(first + r) where the engine's device is cuda[:first], else CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TPGroup:
    def __init__(self, rank: int, size: int, device: torch.device, control):
        self.rank, self.size, self.device = rank, size, device
        self.control = control
        self.shard = Shard(rank, size)

    @classmethod
    def join(cls, rendezvous: Rendezvous, rank: int, device: torch.device) -> "TPGroup":
        """Joins the group as ``rank``, whose device is ``device`` (rank_device); returns once
        every rank has joined."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group: one "
                               "tensor-parallel engine per process")
        os.environ.update(rendezvous.env(rank))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://",
                                rank=rank, world_size=rendezvous.size)
        control = dist.new_group(backend="gloo", timeout=IDLE_LIMIT)
        return cls(rank, rendezvous.size, device, control)

    @property
    def model_group(self):
        return None  # the default group

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (the others pass nothing and get it back)."""
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min(self, value: int) -> int:
        """The smallest of the ranks' values, on every rank."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.control)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
