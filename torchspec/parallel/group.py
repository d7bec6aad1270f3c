"""The tensor-parallel process group (torch.distributed, launched by torchrun) and what its ranks agree on.

Every rank of a group runs the same engine on the same requests: after each row-parallel all-reduce the
residual stream, hence the logits, are identical on every rank, so each rank's scheduler makes the same
decisions from the same tokens. What could still differ is agreed here: sizes measured from each rank's own
free memory (the smallest wins) and the random state sampling draws from (rank 0's, sent at each run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchspec.parallel.layout import BACKEND_FOR_DEVICE, BackendError, check_backend, check_devices, check_world


@dataclass(frozen=True)
class TensorParallel:
    """This rank's tensor-parallel group: the ranks that hold the shards of one model replica."""

    group: dist.ProcessGroup
    rank: int
    size: int
    device: torch.device

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place (the partial products of a row-parallel projection)."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value``: a pool sized from one rank's free memory must fit on all."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def check_same(self, fingerprint: int, what: str) -> None:
        """Raise on every rank unless all ranks hold the same ``fingerprint`` (below 2**62 in magnitude, as
        ``hash`` of ints and tuples is): ranks are meant to agree by construction, and a kernel that is not
        deterministic would otherwise make them compute from different tokens without any error."""
        tensor = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        highest, lowest = tensor[0].item(), -tensor[1].item()
        if highest != lowest:
            raise RuntimeError(
                f"tensor-parallel ranks disagree on {what} (a kernel that is not deterministic, or random states set "
                "apart from the engine); "
                "the outputs of this call are not to be trusted"
            )

    def sync_rng(self) -> None:
        """Give every rank the group's rank-0 random state on the model's device, so sampling draws the same
        tokens everywhere (a rank that drew differently would schedule differently and stall the group)."""
        cuda = self.device.type == "cuda"
        state = [torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()]
        dist.broadcast_object_list(state, group=self.group, group_src=0, device=self.device)
        if cuda:
            torch.cuda.set_rng_state(state[0], self.device)
        else:
            torch.set_rng_state(state[0])


def launched_world_size() -> int:
    """Processes torchrun launched (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank in the world torchrun launched (0 without torchrun): rank 0 reports for all."""
    return int(os.environ.get("RANK", "0"))


def rank_device(device: torch.device) -> torch.device:
    """This rank's own GPU under torchrun (``cuda:LOCAL_RANK``) for a CUDA device; ``device`` otherwise."""
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def init_distributed(device: torch.device, purpose: str) -> None:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) with the backend
    ``device`` needs, unless the caller already initialised one."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        raise BackendError(
            f"{purpose} needs torch.distributed, which is not initialised: launch with torchrun "
            "(torchrun --nproc-per-node N ...) or call torch.distributed.init_process_group() first"
        )
    backend = BACKEND_FOR_DEVICE.get(device.type, "gloo")
    if not dist.is_backend_available(backend):
        raise BackendError(f"{purpose} on {device.type} needs the {backend!r} backend, which this torch lacks")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)


def tensor_parallel(size: int, device: torch.device) -> TensorParallel:
    """This rank's group of ``size`` consecutive ranks (ranks ``r * size ...`` hold replica ``r``), checked."""
    init_distributed(device, f"tensor_parallel_size={size}")
    world = dist.get_world_size()
    check_world(size, world)
    check_backend(dist.get_backend(), device.type)
    devices = torch.cuda.device_count() if device.type == "cuda" else 0
    check_devices(device.type, int(os.environ.get("LOCAL_WORLD_SIZE", size)), devices)
    mesh = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("replica", "tensor"))
    group = mesh.get_group("tensor")
    return TensorParallel(group, dist.get_rank(group), size, device)
