"""torchspec: lossless sparse self-speculative decoding for Hugging Face causal LMs."""

from torchspec import sparsespec
from torchspec.causal_lm import RequestOutput, SparseSpecForCausalLM
from torchspec.config import SpecConfig
from torchspec.request import SamplingParams
from torchspec.sparsespec import wrap
from torchspec.stats import GenerationStats, RequestStats

__version__ = "0.1.0"
__all__ = [
    "GenerationStats",
    "RequestOutput",
    "RequestStats",
    "SamplingParams",
    "SparseSpecForCausalLM",
    "SpecConfig",
    "__version__",
    "sparsespec",
    "wrap",
]
