"""Token selection for every phase, lossless by construction.

Greedy: a draft is accepted while it equals the target's argmax, and the first mismatch is replaced by the
argmax, so the output is exactly plain greedy decoding. Sampling: speculative rejection sampling on the
*warped* draft (q) and target (p) distributions: accept draft x with probability min(1, p(x) / q(x)), on
rejection sample from norm(max(0, p - q)), after full acceptance sample a bonus token from p; every emitted
token is then distributed exactly as the target's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(target_tokens: Sequence[int], drafts: Sequence[int]) -> tuple[int, list[int]]:
    """``target_tokens`` are the argmax after the newest token and after each draft (``len(drafts) + 1``)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, [*drafts[:accepted], target_tokens[accepted]]


def accept_sampled(
    target_probs: torch.Tensor,
    drafts: Sequence[int],
    draft_probs: Sequence[torch.Tensor],
    generator: torch.Generator | None = None,
) -> tuple[int, list[int]]:
    """Rejection sampling: ``target_probs`` is ``[len(drafts) + 1, V]``, ``draft_probs[i]`` is ``[V]``."""
    uniforms = torch.rand(len(drafts), generator=generator, device=target_probs.device).tolist()
    for i, token in enumerate(drafts):
        target, draft = target_probs[i], draft_probs[i]
        p, q = float(target[token]), float(draft[token])
        if uniforms[i] * q < p:  # u < p/q without dividing; strict, so p = 0 is never accepted (u can be 0)
            continue
        residual = (target - draft).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any sample from p is exact
            residual = target
        corrected = int(torch.multinomial(residual, 1, generator=generator))
        return i, [*drafts[:i], corrected]
    bonus = int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))
    return len(drafts), [*drafts, bonus]
