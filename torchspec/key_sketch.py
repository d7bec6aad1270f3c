"""Key sketches: compact copies of the cached keys that approximate a query's logits ``q . k`` for every position.

A query-aware draft (``query_sketch``) scores the whole context from its draft queries; reading the full keys for
that would cost a verify's K reads. A sketch keeps a few bytes a key instead, chosen here by kind and width:

- ``int``: each key quantised symmetrically to ``width`` bits a channel, one scale a key and KV head;
- ``lowrank``: each key projected on the ``width`` principal directions of the request's prompt keys (per
  layer and KV head; Loki-style), plus their mean;
- ``channels``: the ``width`` channels of largest energy in the prompt keys, taken as rotary pairs (a pair's
  norm does not change as RoPE rotates it with the position, so the prompt's choice holds at any length);
- ``exact``: the keys themselves (the bound the others approach, at a full read of K).

``int4`` is the one the KV pool keeps, written beside the K/V as keys are stored (``KVPool.codes``, scored by the
op ``sketch_mass``). The others, kept for the study of docs/acceptance.md, are computed here from the full keys,
which gives the numbers a stored sketch would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeySketch:
    kind: str  # exact, int, lowrank or channels
    width: int  # bits a channel (int), directions (lowrank), channels (channels); unused for exact

    @property
    def stored(self) -> bool:
        """Whether the KV pool keeps this sketch (int4: ``attention.reference.store_key_sketch``)."""
        return self.kind == "int" and self.width == 4

    def bytes_per_key(self, head_dim: int) -> float:
        """Bytes a position and KV head holds (bf16 values, an fp32 scale for ``int``, as the pool keeps int4)."""
        if self.kind == "exact":
            return 2.0 * head_dim
        if self.kind == "int":
            return head_dim * self.width / 8 + 4
        return 2.0 * self.width

    def fit(self, prompt_keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the sketch learns from a request's prompt keys ``[P, Hkv, D]`` of one layer (nothing for
        ``exact`` and ``int``): ``lowrank`` the keys' mean ``[Hkv, D]`` and principal directions ``[Hkv, D, r]``,
        ``channels`` the channel indices ``[Hkv, r]``."""
        keys = prompt_keys.float().transpose(0, 1)  # [Hkv, P, D]
        if self.kind == "lowrank":
            mean = keys.mean(dim=1)
            _, _, vh = torch.linalg.svd(keys - mean[:, None], full_matrices=False)  # vh: [Hkv, min(P, D), D]
            return mean, vh[:, : self.width].transpose(1, 2)
        if self.kind == "channels":
            half = keys.shape[-1] // 2
            energy = keys.square().mean(dim=1)  # [Hkv, D]
            pairs = (energy[:, :half] + energy[:, half:]).topk(min(self.width // 2, half), dim=-1).indices
            return (torch.cat([pairs, pairs + half], dim=-1).sort(dim=-1).values,)
        return ()

    def logits(self, query: torch.Tensor, keys: torch.Tensor, fitted: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Approximate ``q . k`` of each query head of a GQA group against keys of its KV head, for a batch of
        requests: ``query`` ``[N, Hkv, G, D]``, ``keys`` ``[N, Hkv, S, D]``, ``fitted`` each request's ``fit``
        stacked; ``[N, Hkv, G, S]`` in fp32 (unscaled)."""
        query, keys = query.float(), keys.float()
        if self.kind == "int":
            levels = 2 ** (self.width - 1) - 1
            scale = keys.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / levels
            keys = (keys / scale).round().clamp(-levels, levels) * scale
        elif self.kind == "lowrank":
            mean, basis = fitted
            reduced = torch.einsum("nhsd,nhdr->nhsr", keys - mean[:, :, None], basis)
            along_mean = torch.einsum("nhgd,nhd->nhg", query, mean)[..., None]
            return torch.einsum("nhgd,nhdr,nhsr->nhgs", query, basis, reduced) + along_mean
        elif self.kind == "channels":
            (channels,) = fitted
            query = query.gather(-1, channels[:, :, None].expand(-1, -1, query.shape[2], -1))
            keys = keys.gather(-1, channels[:, :, None].expand(-1, -1, keys.shape[2], -1))
        return torch.einsum("nhgd,nhsd->nhgs", query, keys)


#: The sketches ``SpecConfig.key_sketch`` names.
KEY_SKETCHES: dict[str, KeySketch] = {
    "int4": KeySketch("int", 4),
    "int2": KeySketch("int", 2),
    "lowrank16": KeySketch("lowrank", 16),
    "lowrank8": KeySketch("lowrank", 8),
    "lowrank4": KeySketch("lowrank", 4),
    "channels16": KeySketch("channels", 16),
    "channels8": KeySketch("channels", 8),
    "exact": KeySketch("exact", 0),
}
