"""Cheaper forwards: a Llama-family layer's projections as one GEMM each and its small ops as one kernel each.

At batch 256 a small model's forward costs what it launches, not what it computes: transformers' SmolLM2 layer
is ~41 kernels (RMSNorm alone is seven, the rotary embedding ten). Inside an engine run the modules this
recognises run fused forwards instead: q/k/v as one GEMM, gate/up as one GEMM followed by one SiLU x mul
kernel, RMSNorm as one kernel and the rotary embedding inside the kernel that stores the new K/V (``ops``:
Triton on CUDA, the plain-PyTorch reference elsewhere, which computes what transformers computes), and in a
whole pre-norm decoder layer each residual add inside the GEMM before it (``addmm_``, in place). The separate q/k/v and
gate/up weights become views of the fused ones, so nothing is stored twice and the model outside an engine run
is unchanged.

What is recognised: RMSNorm modules of the Llama form (``weight``, ``variance_epsilon``); MLPs with
``gate_proj``/``up_proj``/``down_proj`` and a SiLU; attention modules with ``q_proj``/``k_proj``/``v_proj``/
``o_proj`` and optional per-head ``q_norm``/``k_norm``; decoder layers made of exactly those four (Llama,
Mistral, Qwen2, Qwen3, ...). A probe forward at build time compares the fused model with the model's own
forward; if they differ, nothing is fused.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType, SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from torchspec.hf import (
    _ProbeContext,
    forward_context,
    paged_attention_forward,
    replaced_forwards,
    routed_attention,
)
from torchspec.kv_cache import LayerSpec

Ops = ModuleType | SimpleNamespace
# Largest difference of the fused probe's logits from the model's own, relative to their largest magnitude.
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-2, torch.bfloat16: 5e-2}
_ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}


class FusedLayers:
    """The fused forwards of one model, installed on its modules for the duration of an engine run."""

    def __init__(
        self, model: nn.Module, layers: Sequence[LayerSpec], ops: Ops, model_dtype: dict[nn.Module, Callable]
    ) -> None:
        """``model_dtype``: the engine's forwards that keep the model out of a client's autocast
        (``hf.model_dtype_forwards``), installed for the probe as for a run."""
        self.ops = ops
        self._layers = {spec.layer_idx: spec for spec in layers}
        self._cores: dict[nn.Module, Callable] = {}  # each module's weights are fused once, shared by its users
        self.forwards: dict[nn.Module, Callable] = {}
        for module in model.modules():
            forward = self._fused_forward(module)
            if forward is not None:
                self.forwards[module] = forward
        if self.forwards and not self._matches_model(model, model_dtype):
            self.forwards = {}

    def count(self, kind: str) -> int:
        """How many modules of ``kind`` (``"decoder"``, ``"norm"``, ``"mlp"``, ``"attention"``) run fused."""
        return sum(forward.__name__ == f"fused_{kind}" for forward in self.forwards.values())

    def installed(self) -> contextlib.AbstractContextManager:
        """Run the fused forwards in place of the modules' own for the duration."""
        return replaced_forwards(self.forwards)

    def _fused_forward(self, module: nn.Module) -> Callable | None:
        if hasattr(module, "_hf_hook") or "forward" in module.__dict__:
            return None  # an accelerate hook (offload, device placement) must keep running
        if _is_rms_norm(module):
            return self._norm_forward(module)
        if _is_silu_mlp(module):
            return self._mlp_forward(module)
        if self._is_attention(module):
            return self._attention_forward(module)
        if self._is_decoder_layer(module):
            return self._decoder_forward(module)
        return None

    def _is_attention(self, module: nn.Module | None) -> bool:
        return getattr(module, "layer_idx", None) in self._layers and _is_plain_attention(module)

    def _is_decoder_layer(self, module: nn.Module) -> bool:
        """A pre-norm layer (norm, attention, residual add, norm, MLP, residual add) of modules fused here."""
        children = dict(module.named_children())
        return (
            set(children) == {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
            and _is_rms_norm(children["input_layernorm"])
            and _is_rms_norm(children["post_attention_layernorm"])
            and self._is_attention(children["self_attn"])
            and _is_silu_mlp(children["mlp"])
            and not any(hasattr(child, "_hf_hook") for child in children.values())
        )

    def _norm_forward(self, norm: nn.Module) -> Callable:
        rms_norm = self.ops.rms_norm

        def fused_norm(hidden_states: torch.Tensor) -> torch.Tensor:
            return rms_norm(hidden_states, norm.weight, norm.variance_epsilon)

        return fused_norm

    def _mlp_core(self, mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> silu(gate(x)) * up(x)``: one GEMM and one kernel (``down_proj`` is left to the caller)."""
        if mlp not in self._cores:
            weight, bias = _fuse_linears([mlp.gate_proj, mlp.up_proj])
            silu_and_mul = self.ops.silu_and_mul
            self._cores[mlp] = lambda x: silu_and_mul(F.linear(x, weight, bias))
        return self._cores[mlp]

    def _mlp_forward(self, mlp: nn.Module) -> Callable:
        core, down_proj = self._mlp_core(mlp), mlp.down_proj

        def fused_mlp(x: torch.Tensor) -> torch.Tensor:
            return down_proj(core(x))

        return fused_mlp

    def _attention_core(self, attention: nn.Module) -> Callable:
        """``(hidden states, (cos, sin)) -> [T, heads x head_dim]``: the attention before ``o_proj``, with q/k/v
        as one GEMM and RoPE done by the kernel that stores the new K/V."""
        if attention in self._cores:
            return self._cores[attention]
        spec = self._layers[attention.layer_idx]
        weight, bias = _fuse_linears([attention.q_proj, attention.k_proj, attention.v_proj])
        ops = self.ops
        heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)

        def core(hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            qkv = F.linear(hidden_states, weight, bias).view(-1, heads + 2 * kv_heads, head_dim)
            query, key, value = qkv.split([heads, kv_heads, kv_heads], dim=1)
            if q_norm is not None:
                query = ops.rms_norm(query, q_norm.weight, q_norm.variance_epsilon)
                key = ops.rms_norm(key, k_norm.weight, k_norm.variance_epsilon)
            out, _ = paged_attention_forward(
                attention,
                *(t.transpose(0, 1)[None] for t in (query, key, value)),
                None,
                scaling=spec.scaling,
                sliding_window=spec.sliding_window,
                rotary=tuple(t.reshape(-1, head_dim) for t in position_embeddings),
            )
            return out.view(out.shape[1], -1)

        self._cores[attention] = core
        return core

    def _attention_forward(self, attention: nn.Module) -> Callable:
        core, o_proj = self._attention_core(attention), attention.o_proj

        def fused_attention(
            hidden_states: torch.Tensor,
            position_embeddings: tuple[torch.Tensor, torch.Tensor],
            attention_mask: torch.Tensor | None = None,
            **kwargs: object,
        ) -> tuple[torch.Tensor, None]:
            out = core(hidden_states, position_embeddings)
            return o_proj(out.view(*hidden_states.shape[:-1], -1)), None

        return fused_attention

    def _decoder_forward(self, layer: nn.Module) -> Callable:
        """The whole layer with each residual add done by its GEMM, in place on the residual stream (``addmm_``:
        the add happens in the GEMM's fp32 epilogue, so the sum is rounded once where transformers rounds twice).
        The layer's input is the residual stream, which nothing else reads after the layer (an engine run asks
        for no hidden states)."""
        attention, mlp = self._attention_core(layer.self_attn), self._mlp_core(layer.mlp)
        first_norm, second_norm = (
            self._norm_forward(layer.input_layernorm),
            self._norm_forward(layer.post_attention_layernorm),
        )
        o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj

        def fused_decoder(
            hidden_states: torch.Tensor,
            *args: object,
            position_embeddings: tuple[torch.Tensor, torch.Tensor],
            **kwargs: object,
        ) -> torch.Tensor:
            residual = hidden_states.view(-1, hidden_states.shape[-1])
            _add_linear_(residual, attention(first_norm(residual), position_embeddings), o_proj)
            _add_linear_(residual, mlp(second_norm(residual)), down_proj)
            return hidden_states

        return fused_decoder

    def _matches_model(self, model: nn.Module, model_dtype: dict[nn.Module, Callable]) -> bool:
        """Whether a probe forward gives the model's own logits with the fused forwards; warns if not."""
        parameter = next(model.parameters())
        vocab = model.get_input_embeddings().num_embeddings
        input_ids = (torch.arange(8, device=parameter.device) * 7919 % vocab)[None]
        positions = torch.arange(8, device=parameter.device)[None]

        def logits() -> torch.Tensor:
            with forward_context(_ProbeContext()):
                return model(input_ids=input_ids, position_ids=positions, use_cache=False).logits.float()

        with torch.inference_mode(), routed_attention(model), replaced_forwards(model_dtype):
            own = logits()
            try:
                with self.installed():
                    fused = logits()
                error = ((fused - own).abs().max() / own.abs().max().clamp_min(1e-6)).item()
                if error <= PROBE_TOLERANCE.get(parameter.dtype, 5e-2):
                    return True
                problem = f"give logits {error:.2g} away from the model's own forward"
            except (RuntimeError, TypeError, ValueError) as failure:  # a layer this transformers calls otherwise
                problem = f"failed on a probe forward ({type(failure).__name__}: {failure})"
        warnings.warn(
            f"torchspec: the fused layers of {type(model).__name__} {problem}, so the model runs unfused (slower); "
            "pass fuse_layers=False to silence this",
            stacklevel=3,
        )
        return False


def _add_linear_(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> None:
    """``residual += linear(x)`` as one GEMM. In place because an out-of-place ``addmm`` first copies its input
    into the result on CUDA (PyTorch's cuBLAS path for it adds in place only): one more kernel per residual add,
    60 per SmolLM2 forward. A subclass of ``nn.Linear`` (a tensor-parallel shard, whose forward sums over ranks)
    runs its own forward."""
    if type(linear) is not nn.Linear:
        residual.add_(linear(x))
        return
    if linear.bias is not None:
        residual.add_(linear.bias)
    residual.addmm_(x, linear.weight.t())


def _is_rms_norm(module: nn.Module | None) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and not any(module.children())
    )


def _is_silu_mlp(module: nn.Module) -> bool:
    names = ("gate_proj", "up_proj", "down_proj")
    return (
        all(isinstance(getattr(module, name, None), nn.Linear) for name in names)
        and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        and {name for name, _ in module.named_children()} == {*names, "act_fn"}
        and _fusable([module.gate_proj, module.up_proj])
    )


def _is_plain_attention(module: nn.Module) -> bool:
    children = dict(module.named_children())
    projections = [children.get(name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    norms = [children.get(name) for name in ("q_norm", "k_norm")]
    head_dim = getattr(module, "head_dim", None)
    return (
        set(children) <= _ATTENTION_CHILDREN
        and all(isinstance(p, nn.Linear) for p in projections)
        and _fusable(projections[:3])
        and (norms == [None, None] or all(_is_rms_norm(n) and n.weight.numel() == head_dim for n in norms))
    )


def _fusable(linears: list[nn.Linear]) -> bool:
    """Plain floating weights on one device and dtype, with biases on all or none."""
    weights = [linear.weight for linear in linears]
    return (
        all(type(w) in (torch.Tensor, nn.Parameter) and w.is_floating_point() for w in weights)
        and len({(w.device, w.dtype, w.shape[1]) for w in weights}) == 1
        and len({linear.bias is None for linear in linears}) == 1
    )


def _fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking ``linears``' outputs; each linear's own parameter keeps its identity and
    becomes a view of it (``.data``), so training still reaches it: an optimizer made before or after ``wrap()``
    updates the fused weight in place, and the next rollout reads it. Made outside inference mode, whatever the
    caller's: an inference tensor cannot take part in a backward pass (the q/k/v and gate/up weights of a
    wrapped model stopped training under TRL)."""

    def fuse(name: str) -> torch.Tensor:
        parts = [getattr(linear, name) for linear in linears]
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([part.detach() for part in parts])
            for part, view in zip(parts, fused.split([p.shape[0] for p in parts]), strict=True):
                part.data = view
        return fused

    return fuse("weight"), fuse("bias") if linears[0].bias is not None else None
