"""Attention kernels over a paged KV cache (page size 1): functions on tensors, no engine concepts.

``attention.reference`` is the plain-PyTorch specification; fast implementations expose the same
functions with the same signatures, so the engine swaps one module for another.
"""

from attention import reference

__all__ = ["reference"]
