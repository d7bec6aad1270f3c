"""Tiny random transformers models, left-padded batches and cached transformers references for parity tests.

Models are built from small configs with ``initializer_range=0.2`` so greedy logits are peaked: a tiny model
with the usual 0.02 init has near-ties that any fp32 rounding difference flips. A :class:`TinyModelSpec` is
hashable and builds the same weights every time (its own seed), so the transformers reference of a spec can
be computed once per session, on a model object of its own, and reused by every test of that spec.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 128
BOS_TOKEN_ID = 1
PAD_TOKEN_ID = 2  # not 0, so padding with a hard-coded 0 would show
FIRST_PROMPT_TOKEN = 3  # prompts never contain bos or pad
NUM_HEADS = 4
HEAD_DIM = 16

CONFIG_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}

# No EOS by default: rows run to max_new_tokens unless a test chooses an EOS id.
_BASE_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": NUM_HEADS * HEAD_DIM,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": NUM_HEADS,
    "head_dim": HEAD_DIM,  # Qwen3 defaults to 128 otherwise
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "eos_token_id": None,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": BOS_TOKEN_ID,
}
# Mistral and Qwen default to a 4096-token window; keep the plain specs full-attention.
_NO_WINDOW: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False},
}


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class TinyModelSpec:
    """A tiny random causal LM: architecture, KV heads, config overrides (sorted key/value pairs), seed."""

    arch: str
    num_kv_heads: int = 2
    overrides: tuple[tuple[str, Any], ...] = ()
    seed: int = 0

    def with_config(self, **overrides: Any) -> TinyModelSpec:
        """The same weights (same seed and shapes) with other config values, e.g. an EOS id or no window."""
        merged = dict(self.overrides) | {k: _hashable(v) for k, v in overrides.items()}
        return replace(self, overrides=tuple(sorted(merged.items())))

    @property
    def id(self) -> str:
        """Short test id, e.g. ``qwen2-kv2-sw8-SF`` (S/F: sliding or full attention per layer)."""
        values = dict(self.overrides)
        parts = [self.arch, f"kv{self.num_kv_heads}"] + ([f"seed{self.seed}"] if self.seed else [])
        if values.get("sliding_window") and values.get("use_sliding_window", self.arch == "mistral"):
            parts.append(f"sw{values['sliding_window']}")
        if "layer_types" in values:
            parts.append("".join(kind[0].upper() for kind in values["layer_types"]))
        if values.get("eos_token_id") is not None:
            parts.append(f"eos{values['eos_token_id']}")
        return "-".join(parts)

    def config(self) -> Any:
        values = _BASE_CONFIG | _NO_WINDOW[self.arch] | {"num_key_value_heads": self.num_kv_heads}
        values |= {k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides}
        return CONFIG_CLASSES[self.arch](**values)

    def build(self) -> torch.nn.Module:
        """A fresh fp32 model in eval mode; the global RNG is left untouched."""
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            # deepcopy: from_config keeps the config object, and wrap() edits the model's config in place.
            return AutoModelForCausalLM.from_config(copy.deepcopy(self.config())).eval()


#: A tiny Qwen3 shape that ``torchspec bench --model-config`` measures on a CPU (added to the known ones).
TINY_SHAPE = {
    "vocab_size": 128,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def tiny_spec(arch: str, num_kv_heads: int = 2, seed: int = 0, **overrides: Any) -> TinyModelSpec:
    return TinyModelSpec(arch, num_kv_heads, seed=seed).with_config(**overrides)


@dataclass(frozen=True)
class Batch:
    """A left-padded batch of random prompts (token ids in [FIRST_PROMPT_TOKEN, vocab))."""

    lengths: tuple[int, ...]
    seed: int = 0

    @property
    def prompts(self) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed)
        return [torch.randint(FIRST_PROMPT_TOKEN, VOCAB_SIZE, (n,), generator=generator).tolist() for n in self.lengths]

    @property
    def width(self) -> int:
        return max(self.lengths)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), both ``[B, width]``, padded on the left with PAD_TOKEN_ID."""
        input_ids = torch.full((len(self.lengths), self.width), PAD_TOKEN_ID, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(self.prompts):
            input_ids[row, self.width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, self.width - len(prompt) :] = 1
        return input_ids, attention_mask

    def kwargs(self) -> dict[str, torch.Tensor]:
        input_ids, attention_mask = self.tensors()
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def small_continuous_batching() -> ContinuousBatchingConfig:
    """transformers' continuous batching run small on the CPU (a cache sized from free memory takes ~30 s to set
    up); its page size is ``block_size`` up to transformers 5.17 (the GPU machine's) and ``page_size`` since."""
    parameters = inspect.signature(ContinuousBatchingConfig).parameters
    page = "page_size" if "page_size" in parameters else "block_size"
    return ContinuousBatchingConfig(**{page: 16}, num_blocks=32, max_batch_tokens=64)


def generated_rows(sequences: torch.Tensor, batch: Batch, eos_token_ids: Sequence[int] = ()) -> list[list[int]]:
    """Each row's generated tokens: up to and including its first EOS, else all of them (padding stripped).

    Padding is found from the EOS, not from PAD_TOKEN_ID, since a random model may generate the pad id.
    """
    rows = []
    for row in sequences[:, batch.width :].tolist():
        stops = [i for i, token in enumerate(row) if token in eos_token_ids]
        rows.append(row[: stops[0] + 1] if stops else row)
    return rows


def logit_margin(model: torch.nn.Module, sequences: torch.Tensor, batch: Batch, row: int, column: int) -> float:
    """Top-1 minus top-2 logit of the model's own forward when it predicted ``sequences[row, column]``."""
    _, attention_mask = batch.tensors()
    prefix = sequences[row : row + 1, :column]
    mask = torch.ones_like(prefix)
    mask[0, : batch.width] = attention_mask[row]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = model(input_ids=prefix, attention_mask=mask, position_ids=positions).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same_tokens(expected: torch.Tensor, actual: torch.Tensor, spec: TinyModelSpec, batch: Batch) -> None:
    """``torch.equal``; on a mismatch, name the first differing token and the reference's logit margin there
    (a margin near 1e-5 means a numerical near-tie, not an engine bug)."""
    if torch.equal(expected, actual):
        return
    if expected.shape != actual.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}\n{actual}\n{expected}")
    row, column = (expected != actual).nonzero()[0].tolist()
    margin = logit_margin(spec.build(), expected, batch, row, column)
    raise AssertionError(
        f"{spec.id}: first difference at row {row}, column {column} (new token {column - batch.width}): "
        f"{actual[row, column].item()} != reference {expected[row, column].item()}; "
        f"transformers' top-1 minus top-2 logit for that token {margin:.3g} (a near-tie if ~1e-5; meaningless "
        "for padding after the row's EOS)"
    )


def assert_no_slot_leak(wrapped: Any) -> None:
    """Every KV slot is back in the free list after a call (and none was handed back twice)."""
    pool = wrapped.engine.pool
    assert pool.allocator.num_free == pool.num_slots, f"{pool.num_slots - pool.allocator.num_free} slots leaked"
    assert sorted(pool.allocator.free_slots().tolist()) == list(range(pool.num_slots)), "free list holds duplicates"


def generate_checking_key_sketches(wrapped: Any, batch: Batch, **generate_kwargs: Any) -> torch.Tensor:
    """``wrapped.generate`` over ``batch`` on a zeroed pool, then: every sketched layer holds the int4 sketch
    (``attention.reference.store_key_sketch``) of each key written during the call, at its slot (a key of zeros,
    e.g. a padding token's embedding, counts as written where its sketch is), and none elsewhere. The scratch slot
    is left out: a padded step's padding tokens all write there, in whatever order the kernels run, so its key and
    its sketch may come from different tokens (it is never read as a real key)."""
    from attention import reference

    pool = wrapped.engine.pool
    sketched = [layer for layer, codes in enumerate(pool.codes) if codes is not None]
    assert sketched, "no layer keeps a key sketch"
    for rows in pool.slot_tensors():
        rows.zero_()
    device = pool.k[0].device
    kwargs = {name: tensor.to(device) for name, tensor in batch.kwargs().items()}
    output = wrapped.generate(**kwargs, **generate_kwargs)
    real = slice(0, pool.scratch_slot)  # every allocatable slot
    for layer in sketched:
        keys, kept_codes, kept_scales = pool.k[layer][real], pool.codes[layer][real], pool.scales[layer][real]
        sketched = kept_scales.ne(0).any(dim=1)  # a sketch's scale is positive
        assert not (keys.flatten(1).ne(0).any(dim=1) & ~sketched).any(), f"layer {layer}: a key not sketched"
        codes, scales = torch.zeros_like(kept_codes), torch.zeros_like(kept_scales)
        reference.store_key_sketch(keys, sketched.nonzero()[:, 0], codes, scales)
        assert torch.equal(kept_codes, codes) and torch.equal(kept_scales, scales), f"layer {layer}"
    return output


Reference = Callable[..., torch.Tensor]


@pytest.fixture
def small_wave(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter runs one program at a time: a nominal wave of 12 programs (not an H200's 528) keeps quick
    the grids of graph replays, which grow to fill a wave (``paged._replay_plan``)."""
    if not torch.cuda.is_available():
        from attention import paged

        monkeypatch.setattr(paged, "NOMINAL_RESIDENT_PROGRAMS", 12)


@pytest.fixture(scope="session")
def hf_reference() -> Reference:
    """``hf_reference(spec, batch, **generate_kwargs)``: transformers' own greedy ``generate`` output, run on a
    model built for the reference alone and cached for the session (callers get a copy)."""
    cache: dict[tuple, torch.Tensor] = {}

    def reference(spec: TinyModelSpec, batch: Batch, **kwargs: Any) -> torch.Tensor:
        key = (spec, batch, tuple(sorted((k, _hashable(v)) for k, v in kwargs.items())))
        if key not in cache:
            with torch.inference_mode():
                output = spec.build().generate(**batch.kwargs(), do_sample=False, **kwargs)
            cache[key] = output if isinstance(output, torch.Tensor) else output.sequences
        return cache[key].clone()

    return reference


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``torchspec.cli.main(argv)``; argparse exits count too. The CLI seeds torch's
    global RNG, so the caller's RNG state is saved and restored."""
    from torchspec import cli

    with torch.random.fork_rng():
        try:
            code = cli.main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err
