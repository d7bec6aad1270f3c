"""Which layouts of ranks, heads and devices tensor parallelism can run, with errors that say what to change.

Pure functions of numbers and names, so every refusal is testable without a process group or a GPU.
"""

from __future__ import annotations

#: The process-group backend each device type needs for the all-reduces inside a sharded forward.
BACKEND_FOR_DEVICE = {"cuda": "nccl", "cpu": "gloo"}


class LayoutError(ValueError):
    """A tensor-parallel layout that cannot run: heads, ranks or devices that do not divide."""


class BackendError(ValueError):
    """torch.distributed is not initialised, or its backend cannot serve the model's device (a ValueError, like
    every bad option: what to change is how the processes are launched)."""


def check_world(tensor_parallel_size: int, world_size: int) -> None:
    """The world splits into whole tensor-parallel groups (the rest of each split is data-parallel replicas)."""
    if world_size % tensor_parallel_size:
        raise LayoutError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide the world of {world_size} ranks; launch "
            f"a multiple of {tensor_parallel_size} processes (torchrun --nproc-per-node) or change the size"
        )


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, size: int, where: str) -> int:
    """KV heads each rank holds: ``num_kv_heads / size``, or 1 when there are fewer KV heads than ranks, each
    then replicated on the ``size / num_kv_heads`` ranks whose query heads read it."""
    if num_heads % size:
        raise LayoutError(
            f"{where}: {num_heads} attention heads are not divisible by tensor_parallel_size={size}; use a size "
            f"that divides {num_heads}"
        )
    if num_kv_heads % size == 0:
        return num_kv_heads // size
    if size % num_kv_heads == 0:
        return 1
    raise LayoutError(
        f"{where}: {num_kv_heads} KV heads can neither be split over tensor_parallel_size={size} ranks nor "
        f"replicated on them (one of the two must divide the other); use a size that divides {num_kv_heads} or a "
        f"multiple of it"
    )


def check_divisible(features: int, size: int, where: str) -> None:
    """An MLP's intermediate width splits evenly over the ranks."""
    if features % size:
        raise LayoutError(
            f"{where}: {features} features are not divisible by tensor_parallel_size={size}; use a size that "
            f"divides {features}"
        )


def check_devices(device_type: str, ranks_on_host: int, devices_on_host: int) -> None:
    """One GPU per rank: two ranks on one GPU would share its memory and serialise its work."""
    if device_type == "cuda" and ranks_on_host > devices_on_host:
        raise LayoutError(
            f"{ranks_on_host} ranks on this host but only {devices_on_host} CUDA devices; launch at most "
            f"{devices_on_host} processes per node (torchrun --nproc-per-node {devices_on_host})"
        )


def check_backend(backend: str, device_type: str) -> None:
    """The process group has the backend the device needs (``backend`` as ``dist.get_backend`` names it:
    ``"gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``)."""
    needed = BACKEND_FOR_DEVICE.get(device_type)
    if needed is None:
        raise BackendError(f"tensor parallel runs on {sorted(BACKEND_FOR_DEVICE)} devices, not {device_type!r}")
    served = {part.split(":")[-1] for part in backend.split(",")}
    if needed not in served:
        raise BackendError(
            f"a model on {device_type} needs the {needed!r} process-group backend, but the group has {backend!r}; "
            f"call torch.distributed.init_process_group({needed!r}) (or 'cpu:gloo,cuda:nccl')"
        )
