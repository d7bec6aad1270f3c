"""Beyond one device: tensor-parallel shards of one model and data-parallel replicas, on torch.distributed.

Replicas (``torchspec.parallel.replicas``) sit above the wrapper and are imported from there; this package's
top holds what the engine itself uses, so importing it never imports the engine.
"""

from torchspec.parallel.group import (
    TensorParallel,
    init_distributed,
    launched_rank,
    launched_world_size,
    rank_device,
    tensor_parallel,
)
from torchspec.parallel.layout import BackendError, LayoutError
from torchspec.parallel.sharding import RowParallelLinear, parallelize

__all__ = [
    "BackendError",
    "LayoutError",
    "RowParallelLinear",
    "TensorParallel",
    "init_distributed",
    "launched_rank",
    "launched_world_size",
    "parallelize",
    "rank_device",
    "tensor_parallel",
]
