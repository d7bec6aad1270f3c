"""The entry point of the product card: ``from torchspec import sparsespec; sparsespec.wrap(model)``."""

from __future__ import annotations

from typing import Any

import torch

from torchspec.causal_lm import SparseSpecForCausalLM
from torchspec.config import SpecConfig
from torchspec.parallel.sharding import parallelize


def wrap(
    model: torch.nn.Module, tokenizer: Any = None, config: SpecConfig | None = None, **options: Any
) -> SparseSpecForCausalLM:
    """Wrap a transformers causal LM so ``generate`` runs on torchspec's engine.

    ``options`` are :class:`SpecConfig` fields (``draft``, ``k``, ``sparsity``, ``max_batch_size``,
    ``kv_capacity_tokens``, ...); pass either them or a ready ``config``. ``tokenizer`` lets
    ``generate_batch`` take strings and return text. With ``tensor_parallel_size`` > 1, every rank of the group
    calls ``wrap`` on the same model (the whole model, loaded on its own device) and it is sharded in place.
    """
    if config is not None and options:
        raise ValueError("pass either a SpecConfig as `config` or its fields as keyword arguments, not both")
    config = config or SpecConfig.from_kwargs(**options)
    size = config.tensor_parallel_size
    tensor_parallel = parallelize(model, size) if size > 1 else None
    return SparseSpecForCausalLM(model, config, tokenizer, tensor_parallel)
