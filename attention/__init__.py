"""Attention kernels over a paged KV cache (page size 1): functions on tensors, no engine concepts.

``attention.reference`` is the plain-PyTorch specification; ``attention.ops`` exposes the Triton kernels of
``attention.paged`` with the same functions and signatures (as ``torch.library`` custom ops), so the engine
swaps one module for the other.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType, SimpleNamespace

import torch

from attention import flex, reference

#: Values of ``SpecConfig.attention_backend``.
BACKENDS: tuple[str, ...] = ("auto", "reference", "triton", "flex")


def load_ops(backend: str, device: torch.device) -> ModuleType | SimpleNamespace:
    """The op module for ``backend``: ``"auto"`` takes Triton on CUDA and the reference elsewhere; ``"flex"``
    is that choice with FlexAttention for prefill steps (``attention.flex``).

    Triton on a CPU tensor runs only in Triton's interpreter (``TRITON_INTERPRET=1``, slow: tests), so that
    combination is refused otherwise. The Triton module is imported only here, after that choice, because
    ``triton.jit`` reads ``TRITON_INTERPRET`` when the kernels are defined.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {list(BACKENDS)}")
    if backend == "flex":
        return flex.with_flex_prefill(load_ops("auto", device))
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "reference"
    if backend == "reference":
        return reference
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device (the model is on {device.type}); use 'reference' or "
            "'auto', or set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter (slow, for tests)"
        )
    return importlib.import_module("attention.ops")


__all__ = ["BACKENDS", "load_ops", "reference"]
