"""SparseSpec-L: sinks + recent window + Top-K of the verify's attention, and an entropy-based choice of k."""

from __future__ import annotations

from collections.abc import Sequence

from torchspec.config import SpecConfig
from torchspec.drafting.pillar import PillarPolicy
from torchspec.kv_cache import LayerSpec
from torchspec.request import Request

DEFAULT_WINDOW = 64  # recent tokens kept when the config sets no recent_window
# Relative step costs: a draft reads the weights and ~5% of the KV cache, a verify the weights and all of
# it (memory-bound decoding, the paper's regime). Speculation only pays when DRAFT_COST < VERIFY_COST.
DRAFT_COST = 0.3
VERIFY_COST = 1.0
MIN_OBSERVATIONS = 8  # accepted and rejected drafts seen before the controller shortens rounds


class SparseSpecLPolicy(PillarPolicy):
    """Draft cache: ``num_sinks`` first tokens, a recent window (``recent_window``, default 64) and the Top-K of
    the previous verify's attention mass for the rest of the budget.

    Controller: it keeps the mean predictive entropy of drafts that were accepted and of drafts that were
    rejected, turns each new draft's entropy into a soft acceptance probability ``pi_i`` (1 at the accepted
    mean, 0 at the rejected mean, linear between), and after draft ``i`` continues only while the chance that
    all drafts so far are accepted, ``P_i = prod pi_j``, exceeds ``C_d * f(i)`` where
    ``f(i) = (1 + sum_{j<=i} P_j) / (i C_d + C_v)``: drafting once more raises the expected tokens per unit
    of cost only then, which is ``k* = argmax_k f(k)`` taken online.
    """

    name = "sparsespec_l"
    uses_draft_entropy = True

    def __init__(self, config: SpecConfig, layers: Sequence[LayerSpec]) -> None:
        super().__init__(config, layers)
        self.num_sinks = config.num_sinks
        self.window = config.recent_window or DEFAULT_WINDOW
        self.entropy_sum = {True: 0.0, False: 0.0}  # accepted, rejected
        self.entropy_count = {True: 0, False: 0}

    def on_round_end(self, request: Request, num_accepted: int) -> None:
        for i, entropy in enumerate(request.round.entropies[: num_accepted + 1]):
            accepted = i < num_accepted
            self.entropy_sum[accepted] += entropy
            self.entropy_count[accepted] += 1

    def acceptance_probability(self, entropy: float) -> float:
        accepted_mean = self.entropy_sum[True] / self.entropy_count[True]
        rejected_mean = self.entropy_sum[False] / self.entropy_count[False]
        if rejected_mean <= accepted_mean:
            return 1.0
        return min(1.0, max(0.0, (rejected_mean - entropy) / (rejected_mean - accepted_mean)))

    def continue_drafting(self, request: Request) -> bool:
        if min(self.entropy_count.values()) < MIN_OBSERVATIONS:
            return True
        all_accepted, expected = 1.0, 0.0
        for entropy in request.round.entropies:
            all_accepted *= self.acceptance_probability(entropy)
            expected += all_accepted
        drafted = len(request.round.entropies)
        return all_accepted > DRAFT_COST * (1 + expected) / (drafted * DRAFT_COST + VERIFY_COST)
