"""Tensor ops one decode step dispatches per decoder layer, with and without fused layers: what a layer launches
on a GPU, counted on any machine.

    python -m benchmarks.layer_ops                       # on a GPU
    TRITON_INTERPRET=1 python -m benchmarks.layer_ops    # elsewhere: the kernels in Triton's interpreter

A random model of SmolLM2's widths (vocabulary cut to 1,000) with one layer, then with two, decodes one step
for 2 requests (``draft=None``, the Triton op set, eager: with CUDA graphs a GPU would count the capture's
warm-up run too, two forwards for one); the difference of the two counts is one layer's. View ops (no kernel)
are left out; ``attend`` is torchspec's attention op, which holds the K/V store (two index copies, or the
rotary-store kernel of a fused layer) and the attention kernel.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.step_profile import random_model
from torchspec import sparsespec

VIEW_OPS = frozenset(
    {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand", "slice",
     "select", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach", "as_strided", "lift_fresh"}
)  # fmt: skip


class _OpNames(TorchDispatchMode):
    """Counts the non-view ops dispatched while active, by name (custom ops count once: their insides are
    one kernel, or a few, that the op launches itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


def step_ops(num_layers: int, fuse_layers: bool, device: torch.device) -> Counter[str]:
    """Ops of one decode step (a second generated token) of a random ``num_layers``-layer model."""
    model = random_model(device, torch.float32, num_hidden_layers=num_layers, vocab_size=1000)
    wrapped = sparsespec.wrap(
        model,
        draft=None,
        fuse_layers=fuse_layers,
        attention_backend="triton",
        kv_capacity_tokens=256,
        cuda_graphs=False,
    )
    input_ids = torch.randint(0, 1000, (2, 8), device=device)
    counts = []
    for new_tokens in (1, 1, 2):  # the first call builds the engine (and its probe forward)
        with _OpNames() as ops:
            wrapped.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        counts.append(ops.names)
    return counts[2] - counts[1]


def layer_ops(fuse_layers: bool, device: torch.device) -> Counter[str]:
    """One decoder layer's share of a decode step's ops."""
    return step_ops(2, fuse_layers, device) - step_ops(1, fuse_layers, device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for fuse in (False, True):
        names = layer_ops(fuse, device)
        listed = ", ".join(f"{count} {name}" for name, count in names.most_common())
        print(f"fuse_layers={fuse}: {sum(names.values())} ops per layer ({listed})")


if __name__ == "__main__":
    main()
