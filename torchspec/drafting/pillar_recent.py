"""PillarAttn with recency: the default draft, the one that beat streaming at the same budget on SmolLM2."""

from __future__ import annotations

from collections.abc import Sequence

from torchspec.config import SpecConfig
from torchspec.drafting.pillar import PillarPolicy
from torchspec.kv_cache import LayerSpec

DEFAULT_WINDOW = 64  # recent tokens before the verify, always attended to
DEFAULT_SUCCESSORS = 4  # positions after each Top-K pick, taken with it


class PillarRecentPolicy(PillarPolicy):
    """PillarAttn's Top-K of the verify's attention mass, within the same budget, plus the two fixes its
    staleness needs (docs/acceptance.md): a recent window (``recent_window``, default 64) that is always
    attended to, and successor expansion (``successors``, default 4): each Top-K pick also brings the positions
    after it, because copy/induction attention moves forward with the query between verifies.

    Measured on SmolLM2 (4 AIME prompts x 2,304 tokens, k=8, budget max(128, 5%)): 5.94 accepted of 8 per
    round against streaming's 5.54 and paper-faithful PillarAttn's 4.33, and at least streaming's in every
    context bucket up to >= 2,048 tokens (5.41 vs 5.40)."""

    name = "pillar_recent"

    def __init__(self, config: SpecConfig, layers: Sequence[LayerSpec]) -> None:
        super().__init__(config, layers)
        self.window = config.recent_window or DEFAULT_WINDOW
        self.successors = config.successors or DEFAULT_SUCCESSORS
