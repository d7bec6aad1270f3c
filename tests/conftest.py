"""Shared fixtures: the embedded SmolLM2 model (loaded once per session and worker) and a one-thread guard; and
the model of how Triton specialises a launch."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator

import pytest
import torch

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    # Workers of one run share the cores: each takes its share of intra-op threads, not all of them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter; triton.jit reads this when a kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in fp32 on CPU."""
    from torchspec.models import load_model

    return load_model(dtype=torch.float32, device="cpu")


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Tiny shapes: intra-op threads only add overhead, and stall badly on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def triton_specialization(function, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """A launch's constexprs and the specialization key Triton's JIT would compile it under (its rule,
    modelled): each pointer's 16-byte alignment and each int's being 1 or a multiple of 16, unless the kernel
    opts that argument out (``do_not_specialize_on_alignment``, ``do_not_specialize``). Two launches with the
    same constexprs and different keys are two compiles on a GPU."""
    parameters = inspect.signature(function.fn).parameters
    unaligned = set(function.kwargs.get("do_not_specialize_on_alignment") or ())
    unspecialized = set(function.kwargs.get("do_not_specialize") or ())
    # Positional arguments first (constexprs usually come as keywords after them).
    values = dict(zip(function.arg_names, args, strict=False)) | {n: kwargs[n] for n in parameters if n in kwargs}
    constexprs, key = [], []
    for name, parameter in parameters.items():
        value = values.get(name)
        if "constexpr" in str(parameter.annotation):
            constexprs.append((name, value))
        elif isinstance(value, torch.Tensor) and name not in unaligned:
            key.append((name, value.data_ptr() % 16 == 0))
        elif type(value) is int and name not in unspecialized:
            key.append((name, value == 1, value % 16 == 0))
    return (function.fn.__name__, *constexprs), tuple(key)
