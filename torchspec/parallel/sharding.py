"""Megatron-style sharding of a Llama-family model over a tensor-parallel group, on plain tensors.

Each rank keeps its attention heads' rows of q/k/v (column parallel) and the matching columns of o_proj (row
parallel), and its share of the MLP's gate/up rows and down_proj columns; o_proj and down_proj sum their
partial products with one all-reduce each, so the residual stream (and everything replicated: embeddings,
norms, lm_head) is the same on every rank. Attention modules reshape by ``head_dim``, so they run on their
local heads unchanged, the probe sees local heads, and the KV pool and draft policies are sized from them.

Plain sliced tensors rather than DTensor: the fused layers concatenate q/k/v and gate/up into one GEMM (local
slices concatenate the same way), our attention op takes plain local tensors, and a forward dispatches no
DTensor ops on the host, which a decoding step at batch 256 cannot afford.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchspec.parallel.group import TensorParallel, tensor_parallel
from torchspec.parallel.layout import LayoutError, check_divisible, kv_heads_per_rank

_ATTRIBUTE = "_torchspec_tensor_parallel"  # the group a model was sharded over, so a second wrap reuses it


class RowParallelLinear(nn.Linear):
    """A linear layer holding this rank's slice of the input features; its output is the sum over the group."""

    def __init__(self, linear: nn.Linear, columns: slice, tp: TensorParallel) -> None:
        nn.Module.__init__(self)
        self.in_features = columns.stop - columns.start
        self.out_features = linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[:, columns].clone(), requires_grad=False)
        self.bias = linear.bias  # added once, after the sum
        self.tensor_parallel = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tensor_parallel.all_reduce_(F.linear(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)


def parallelize(model: nn.Module, size: int) -> TensorParallel:
    """Shard ``model`` in place over this rank's tensor-parallel group of ``size`` ranks (joining the process
    group torchrun describes if none is initialised); a model already sharded over ``size`` is reused."""
    existing = getattr(model, _ATTRIBUTE, None)
    if existing is not None:
        if existing.size != size:
            raise LayoutError(
                f"the model is already sharded over {existing.size} ranks; load it again to shard it over {size}"
            )
        return existing
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise LayoutError(
            "the model's weights are already DTensors (loaded with tp_plan?); load it whole on each rank and let "
            "tensor_parallel_size shard it"
        )
    parameter = next(model.parameters())
    attention, mlps = _plan(model, size)  # every check before anything changes
    tp = tensor_parallel(size, parameter.device)
    for module, kv_heads in attention:
        _shard_attention(module, kv_heads, tp)
    for module in mlps:
        _shard_mlp(module, tp)
    setattr(model, _ATTRIBUTE, tp)
    return tp


def _plan(model: nn.Module, size: int) -> tuple[list[tuple[nn.Module, int]], list[nn.Module]]:
    """The attention modules (with the KV heads each rank keeps) and MLPs to shard; raises on a bad layout."""
    attention, mlps = [], []
    for name, module in model.named_modules():
        if _has_linears(module, "q_proj", "k_proj", "v_proj", "o_proj") and isinstance(
            getattr(module, "head_dim", None), int
        ):
            heads = module.q_proj.out_features // module.head_dim
            kv_heads = module.k_proj.out_features // module.head_dim
            attention.append((module, kv_heads_per_rank(heads, kv_heads, size, name)))
        elif _has_linears(module, "gate_proj", "up_proj", "down_proj"):
            check_divisible(module.gate_proj.out_features, size, name)
            mlps.append(module)
    if not attention:
        raise LayoutError(
            f"tensor parallel shards attention modules with q_proj/k_proj/v_proj/o_proj and head_dim (Llama, "
            f"Mistral, Qwen2/3, ...); {type(model).__name__} has none"
        )
    return attention, mlps


def _has_linears(module: nn.Module, *names: str) -> bool:
    return all(type(getattr(module, name, None)) is nn.Linear for name in names)


def _shard_attention(module: nn.Module, local_kv_heads: int, tp: TensorParallel) -> None:
    """Keep query heads ``[r H/n, (r + 1) H/n)`` and the KV heads they read: a slice of the KV heads, or the one
    KV head that ``n / Hkv`` ranks share when there are fewer KV heads than ranks."""
    head_dim = module.head_dim
    heads = module.q_proj.out_features // head_dim // tp.size
    kv_heads = module.k_proj.out_features // head_dim
    first_kv = tp.rank * local_kv_heads if kv_heads % tp.size == 0 else tp.rank // (tp.size // kv_heads)
    columns = slice(tp.rank * heads * head_dim, (tp.rank + 1) * heads * head_dim)
    _keep_rows(module.q_proj, columns)
    for linear in (module.k_proj, module.v_proj):
        _keep_rows(linear, slice(first_kv * head_dim, (first_kv + local_kv_heads) * head_dim))
    module.o_proj = RowParallelLinear(module.o_proj, columns, tp)
    # Only transformers' own attention (the model's forward outside an engine run) reads these.
    for attribute, value in (
        ("num_heads", heads),
        ("num_key_value_heads", local_kv_heads),
        ("num_key_value_groups", heads // local_kv_heads),
    ):
        if hasattr(module, attribute):
            setattr(module, attribute, value)


def _shard_mlp(module: nn.Module, tp: TensorParallel) -> None:
    width = module.gate_proj.out_features // tp.size
    rows = slice(tp.rank * width, (tp.rank + 1) * width)
    _keep_rows(module.gate_proj, rows)
    _keep_rows(module.up_proj, rows)
    module.down_proj = RowParallelLinear(module.down_proj, rows, tp)


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    """Column parallel: keep output features ``rows`` (a copy, so the full weight can be freed)."""
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = rows.stop - rows.start
