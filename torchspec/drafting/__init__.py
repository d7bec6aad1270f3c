"""Draft policies by name; ``draft=`` in SpecConfig picks one. Adding a policy touches only this package."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType, SimpleNamespace

from torchspec.config import SpecConfig
from torchspec.drafting.base import DraftPolicy
from torchspec.drafting.ngram import NgramPolicy
from torchspec.drafting.oracle import OraclePolicy
from torchspec.drafting.pillar import PillarPolicy
from torchspec.drafting.pillar_quest import PillarQuestPolicy
from torchspec.drafting.pillar_recent import PillarRecentPolicy
from torchspec.drafting.query_sketch import QuerySketchPolicy
from torchspec.drafting.quest import QuestPolicy
from torchspec.drafting.sparsespec_l import SparseSpecLPolicy
from torchspec.drafting.streaming import StreamingPolicy
from torchspec.kv_cache import LayerSpec

POLICIES: dict[str, type[DraftPolicy]] = {
    cls.name: cls
    for cls in (
        PillarRecentPolicy,
        PillarPolicy,
        StreamingPolicy,
        NgramPolicy,
        QuestPolicy,
        SparseSpecLPolicy,
        OraclePolicy,
        PillarQuestPolicy,
        QuerySketchPolicy,
    )
}


def make_policy(
    config: SpecConfig, layers: Sequence[LayerSpec], ops: ModuleType | SimpleNamespace
) -> DraftPolicy | None:
    """The policy ``config.draft`` names, its device work on ``ops`` (an op set), or None for plain decoding."""
    if config.draft is None:
        return None
    policy = POLICIES[config.draft](config, layers)
    policy.ops = ops
    return policy


__all__ = ["POLICIES", "DraftPolicy", "make_policy"]
