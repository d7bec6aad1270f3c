"""Host values to the device without waiting for the GPU.

``torch.tensor(values, device="cuda")`` (and indexing a CUDA tensor with a Python list) copies synchronously:
PyTorch waits for the stream to drain before it returns. Each list turned into step metadata would then stall
the host behind every kernel queued so far, and the host could never run ahead of the GPU (a draft chain's
forwards would each wait for the one before). Staged in pinned memory, the copy is queued like a kernel and
the host goes on; the caching host allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def to_device(
    values: Sequence[Any] | np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """``values`` (numbers, equal-length lists of them, or a NumPy array) as a tensor on ``device``, copied
    asynchronously."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if isinstance(values, np.ndarray):  # torch.tensor cannot pin what it builds from NumPy
        return torch.from_numpy(values).to(dtype).pin_memory().to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def row_index(rows: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """An index selecting ``rows`` of a device tensor: a slice when they are consecutive (no copy, no gather),
    else an index tensor copied asynchronously."""
    if rows and list(rows) == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return to_device(rows, device)
