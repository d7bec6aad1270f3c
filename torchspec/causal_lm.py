"""SparseSpecForCausalLM: a transformers causal LM with torchspec's paged engine behind ``generate``."""

from __future__ import annotations

import numbers
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from torchspec.config import SpecConfig
from torchspec.drafting import POLICIES
from torchspec.engine import Engine, use_adaptive_rounds, use_draft_chain
from torchspec.generation_config import infer_attention_mask, resolve_generation_config
from torchspec.hf import probe_attention_layers
from torchspec.models import find_tokenizer
from torchspec.request import FinishReason, Request
from torchspec.scheduler import StepPlan
from torchspec.stats import GenerationStats, RequestStats

PROGRESS_SECONDS = 0.5  # how often the progress bar's token rate is refreshed


@dataclass(frozen=True)
class RequestOutput:
    """The result of one prompt of ``generate_batch``."""

    index: int  # position in the input list
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens (a stop token that ended the request included)
    text: str | None  # decoded generated tokens, when a tokenizer is known
    finish_reason: str  # "stop", "length" or "error"
    error: str | None
    stats: RequestStats


class SparseSpecForCausalLM(torch.nn.Module):
    """Wraps a transformers decoder-only LM; ``generate`` / ``generate_batch`` run on torchspec's engine.

    The wrapped model is left as it was: its own ``forward`` and ``generate`` still work, and torchspec
    routes attention to its paged ops only while its engine runs.
    """

    def __init__(self, model: torch.nn.Module, config: SpecConfig, tokenizer: Any = None) -> None:
        super().__init__()
        self.model = model
        self.spec_config = config
        self.tokenizer = tokenizer
        self._tokenizer_searched = tokenizer is not None
        self.layers = probe_attention_layers(model)
        # Refuse a bad pairing now, not at first use.
        draft_chain = use_draft_chain(config.draft_chain, POLICIES.get(config.draft), config.unified_schedule)
        use_adaptive_rounds(config.adaptive_rounds, draft_chain)
        self.last_stats = GenerationStats()
        self._engine: Engine | None = None

    # -- transformers look-alike surface ------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def generation_config(self) -> GenerationConfig:
        return self.model.generation_config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's own forward (its original attention implementation)."""
        return self.model(*args, **kwargs)

    @property
    def engine(self) -> Engine:
        """The engine, with its KV pool allocated on first use and kept for later calls."""
        if self._engine is None:
            self._engine = Engine(self.model, self.spec_config, self.layers)
        return self._engine

    # -- generate --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """Like transformers' ``generate`` for decoder-only models, on a (left-)padded ``[B, S]`` batch.

        Returns ``[B, S + n]`` token ids (finished rows padded with ``pad_token_id``; ``n`` is the longest
        generation), or a ``GenerateDecoderOnlyOutput`` when ``return_dict_in_generate=True``.
        """
        input_ids = kwargs.pop("inputs", input_ids)
        if input_ids is None:
            raise ValueError("generate needs `input_ids` ([batch, seq] token ids)")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("`input_ids` must be a 2-D tensor [batch, seq]; tokenize with return_tensors='pt'")
        resolved = resolve_generation_config(self.model, generation_config, kwargs)
        if attention_mask is None:
            attention_mask = infer_attention_mask(input_ids, resolved)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
            )
        max_new_tokens, min_new_tokens = resolved.lengths_for(self.model, input_ids.shape[1])
        params = resolved.sampling_params(max_new_tokens, min_new_tokens)
        engine = self.engine
        requests = []
        for row, (ids, mask) in enumerate(zip(input_ids.cpu(), attention_mask.cpu().bool(), strict=True)):
            prompt = ids[mask].tolist()
            try:
                engine.check_request(prompt, params)
            except ValueError as error:
                raise ValueError(f"batch row {row}: {error}") from None
            requests.append(Request(request_id=row, prompt_ids=prompt, params=params))
        self.last_stats = engine.run(requests)
        failed = [r for r in requests if r.finish_reason is FinishReason.ERROR]
        if failed:
            raise RuntimeError(f"generation failed for batch row {failed[0].request_id}: {failed[0].error}")
        width = max(r.num_output_tokens for r in requests)
        fill = resolved.pad_token_id if resolved.pad_token_id is not None else 0
        generated = torch.full((len(requests), width), fill, dtype=input_ids.dtype)
        for row, request in enumerate(requests):
            generated[row, : request.num_output_tokens] = torch.tensor(request.output_ids, dtype=input_ids.dtype)
        sequences = torch.cat([input_ids, generated.to(input_ids.device)], dim=1)
        if resolved.config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    # -- generate_batch ----------------------------------------------------------------------------------
    def _requests_for(
        self, inputs: Sequence[str | Sequence[int]], generation_config: GenerationConfig | None, kwargs: dict
    ) -> list[Request]:
        resolved = resolve_generation_config(self.model, generation_config, kwargs)
        resolved.sampling_params(0, 0).validate()  # call-wide values (temperature, top-p...) fail the call
        engine = self.engine
        requests = []
        for index, item in enumerate(inputs):
            try:
                prompt = self._tokenize(item)
                params = resolved.sampling_params(*resolved.lengths_for(self.model, len(prompt)))
            except ValueError as error:
                request = Request(request_id=index, prompt_ids=[], params=resolved.sampling_params(0, 0))
                request.finish(FinishReason.ERROR, str(error))
                requests.append(request)
                continue
            requests.append(engine.new_request(index, prompt, params))
        return requests

    @torch.inference_mode()
    def generate_batch(
        self,
        inputs: Sequence[str | Sequence[int]],
        generation_config: GenerationConfig | None = None,
        progress_bar: bool = True,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate for a list of prompts of any lengths (token id lists, or strings with a tokenizer) with
        continuous batching. Returns one :class:`RequestOutput` per input, in input order; a bad prompt is
        reported in its output (``finish_reason="error"``) and the others complete."""
        if isinstance(inputs, (str, torch.Tensor)) or not isinstance(inputs, Sequence):
            raise TypeError("generate_batch takes a list of prompts (strings or token id lists)")
        requests = self._requests_for(inputs, generation_config, dict(kwargs))
        with tqdm(total=len(requests), unit="req", disable=not progress_bar, desc="generate") as bar:
            bar.update(sum(r.is_finished for r in requests))
            start = time.perf_counter()

            shown = start  # when the rate was last shown

            def on_step(plan: StepPlan, finished: list[Request]) -> None:
                nonlocal shown
                now = time.perf_counter()
                if now - shown >= PROGRESS_SECONDS:  # a count over every request, not paid at every step
                    generated = sum(r.num_output_tokens for r in requests)
                    bar.set_postfix_str(f"{generated} tok, {generated / (now - start):.1f} tok/s", False)
                    shown = now
                bar.update(len(finished))

            self.last_stats = self.engine.run(requests, on_step=on_step)
        return [self._output(r) for r in requests]

    @torch.inference_mode()
    def stream(
        self, prompt: str | Sequence[int], generation_config: GenerationConfig | None = None, **kwargs: Any
    ) -> Iterator[list[int]]:
        """Generate for one prompt, yielding the new token ids of each step as they are produced."""
        (request,) = self._requests_for([prompt], generation_config, dict(kwargs))
        if request.error is not None:
            raise ValueError(request.error)
        emitted = request.num_output_tokens
        for _ in self.engine.steps([request]):
            if request.num_output_tokens > emitted:
                yield request.output_ids[emitted:]
                emitted = request.num_output_tokens
        self.last_stats = self.engine.stats_for([request])

    def _tokenize(self, item: str | Sequence[int]) -> list[int]:
        if isinstance(item, str):
            if not self._tokenizer_searched:
                self.tokenizer, self._tokenizer_searched = find_tokenizer(self.model), True
            if self.tokenizer is None:
                raise ValueError(
                    "a text prompt needs a tokenizer and none was found beside the model: pass tokenizer= to "
                    "sparsespec.wrap(), or give token ids"
                )
            return list(self.tokenizer(item, add_special_tokens=False)["input_ids"])
        if hasattr(item, "tolist"):  # torch / numpy arrays
            item = item.tolist()
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in item):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return [int(t) for t in item]

    def _output(self, request: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None and request.finish_reason is not FinishReason.ERROR:
            text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        end = request.finish_time if request.finish_time is not None else request.arrival_time
        return RequestOutput(
            index=request.request_id,
            prompt_ids=request.prompt_ids,
            token_ids=request.output_ids,
            text=text,
            finish_reason=request.finish_reason.value if request.finish_reason else "error",
            error=request.error,
            stats=RequestStats(
                prompt_tokens=request.num_prompt_tokens,
                generated_tokens=request.num_output_tokens,
                latency_s=end - request.arrival_time,
                time_to_first_token_s=None
                if request.first_token_time is None
                else request.first_token_time - request.arrival_time,
                speculation=request.spec_stats,
            ),
        )
