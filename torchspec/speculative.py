"""Token selection for every phase, lossless by construction.

Greedy: a draft is accepted while it equals the target's argmax, and the first mismatch is replaced by the
argmax, so the output is exactly plain greedy decoding. Sampling: speculative rejection sampling on the
*warped* draft (q) and target (p) distributions: accept draft x with probability min(1, p(x) / q(x)), on
rejection sample from norm(max(0, p - q)), after full acceptance sample a bonus token from p; every emitted
token is then distributed exactly as the target's.
"""

from __future__ import annotations

import torch

from torchspec.draft_probs import KeptDistributions
from torchspec.sampling import DenseProbs, WarpedLogits


def accept_greedy(
    target_tokens: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance for a batch of rounds at once, on the device: round j's argmax after its newest token
    and after each draft are ``target_tokens[j]`` (``[J, n + 1]``), its drafts ``drafts[j]`` (``[J, n]``), entries
    past ``num_drafts[j]`` padding. Returns ``accepted[j]``, the drafts equal to the argmax before the first
    mismatch, and ``next_token[j]``, the argmax after them: round j emits ``drafts[j, :accepted[j]]`` then
    ``next_token[j]``."""
    n = drafts.shape[1]
    steps = torch.arange(n, device=drafts.device)
    matches = (drafts == target_tokens[:, :n]) & (steps < num_drafts[:, None])
    accepted = matches.long().cumprod(dim=1).sum(dim=1)
    return accepted, target_tokens.gather(1, accepted[:, None])[:, 0]


def accept_sampled(
    target: DenseProbs | WarpedLogits,
    target_rows: torch.Tensor,
    drafts: torch.Tensor,
    kept: KeptDistributions | None,
    kept_rows: torch.Tensor | None,
    num_drafts: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for a batch of rounds at once (one random draw per tensor, no host round trip).

    Round j's target distributions (after the newest token and after each draft) are rows ``target_rows[j]``
    (``[J, n + 1]``) of ``target``; its drafts are ``drafts[j]`` (``[J, n]``), drawn from the distributions
    ``kept_rows[j]``, columns ``:n``, of ``kept`` (None when ``n`` is 0: plain steps draw from p alone). Entries
    past ``num_drafts[j]`` are padding, never read as distributions. Only what the rule needs is read: p and q of
    each draft, and for the draw after them one row of p (read in place by ``target.sample``) less, after a
    rejection, the rejected draft's q, never the rounds' ``[J, n, V]`` distributions (at W1's 256 rounds x 8
    drafts x 49K, each such copy costs the GPU ~0.3 ms). Returns ``accepted[j]``, the drafts kept, and
    ``next_token[j]``, the corrected token after a rejection or the bonus token after full acceptance: round j
    emits ``drafts[j, :accepted[j]]`` then ``next_token[j]``.
    """
    num_rounds, n = drafts.shape
    device = drafts.device
    if n == 0:  # plain decode steps: a sample from p
        return num_drafts.new_zeros(num_rounds), target.sample(target_rows[:, 0], generator)
    uniforms = torch.rand(num_rounds, n, generator=generator, device=device)
    steps = torch.arange(n, device=device)
    p = target.at(target_rows[:, :n], drafts)
    q = kept.drawn[kept_rows[:, None], steps]
    # u < p / q without dividing; strict, so p = 0 is never accepted (u can be 0)
    rejected = (steps < num_drafts[:, None]) & ~(uniforms * q < p)
    first_rejected = torch.where(rejected, steps, n).amin(dim=1)
    accepted = first_rejected.minimum(num_drafts)
    rounds = torch.arange(num_rounds, device=device)
    # After a rejection, from p less the rejected draft's q (p == q up to rounding leaves no residual mass, and
    # any sample from p is then exact); after every draft was accepted, the bonus token from p.
    q_rows = torch.where(accepted < num_drafts, kept_rows * kept.columns + accepted.clamp(max=n - 1), -1)
    minus, minus_rows = kept.dense(q_rows, target.vocab_size)
    next_token = target.sample(target_rows[rounds, accepted], generator, minus, minus_rows)
    return accepted, next_token
