"""SparseSpecForCausalLM: a transformers causal LM with torchspec's paged engine behind ``generate``."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import GenerationConfig
from transformers.generation.continuous_batching import RequestStatus as TransformersRequestStatus
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from torchspec.config import SpecConfig
from torchspec.drafting import POLICIES
from torchspec.engine import Engine, use_adaptive_rounds, use_draft_chain
from torchspec.generation_config import infer_attention_mask, resolve_generation_config
from torchspec.hf import probe_attention_layers
from torchspec.models import find_tokenizer
from torchspec.parallel.group import TensorParallel
from torchspec.request import FinishReason, Request
from torchspec.stats import GenerationStats, RequestStats
from torchspec.step import StepPlan
from torchspec.stopping import CriteriaBatch
from torchspec.streamer import StreamedColumns

PROGRESS_SECONDS = 0.5  # how often the progress bar's token rate is refreshed


@dataclass(frozen=True)
class RequestOutput:
    """The result of one prompt of ``generate_batch``.

    It also answers as transformers' continuous-batching ``GenerationOutput`` does (``request_id``,
    ``prompt_ids``, ``generated_tokens``, ``error``, ``status``, ``timestamps``, ``is_finished()``), so code
    written for ``transformers``' ``generate_batch`` (TRL's rollouts, for one) reads it unchanged.
    """

    index: int  # position in the input list
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens (a stop token that ended the request included)
    text: str | None  # decoded generated tokens, when a tokenizer is known
    finish_reason: str  # "stop", "length" or "error"
    error: str | None
    stats: RequestStats
    child: int | None = None  # which further sample of the prompt it is (``num_return_sequences``); None: the first

    @property
    def request_id(self) -> str:
        """transformers' id for the ``index``-th prompt of a call (``"req_0"``, ``"req_1"``, ...); its further samples
        are its children, ``"req_0__child#0"``, ``"req_0__child#1"``, ..."""
        return f"req_{self.index}" if self.child is None else f"req_{self.index}__child#{self.child}"

    @property
    def generated_tokens(self) -> list[int]:
        """``token_ids`` under transformers' name."""
        return self.token_ids

    @property
    def status(self) -> TransformersRequestStatus:
        """FAILED when the request reported an error, else FINISHED: every output is final."""
        return TransformersRequestStatus.FAILED if self.error is not None else TransformersRequestStatus.FINISHED

    @property
    def timestamps(self) -> None:
        """Per-token times are not recorded (transformers' value without ``record_timestamps``)."""
        return None

    def is_finished(self) -> bool:
        """Always True, as for every output transformers' ``generate_batch`` returns."""
        return True


def by_request_id(outputs: Iterable[RequestOutput]) -> dict[str, RequestOutput]:
    """``outputs`` keyed by their request ids, in their order: ``generate_batch``'s result."""
    return {output.request_id: output for output in outputs}


# nn.Module state that says what a module holds and how it is saved: the wrapper shares the model's.
_SHARED_MODULE_STATE = (
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_modules",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
# The wrapper's own attributes; every other one is the wrapped model's, read and assigned.
_OWN_ATTRIBUTES = frozenset(
    {
        "hf_model",
        "spec_config",
        "tokenizer",
        "_tokenizer_searched",
        "layers",
        "last_stats",
        "_engine",
        "tensor_parallel",
    }
)


def _model_method(name: str) -> Callable[..., Any]:
    """The nn.Module method ``name`` as the model's class defines it; where the model returns itself, the
    wrapper returns itself (``wrapped.to(device)`` stays wrapped)."""

    def method(self: SparseSpecForCausalLM, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.hf_model, name)(*args, **kwargs)
        return self if result is self.hf_model else result

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The wrapped model's own ``{name}``."
    return method


class SparseSpecForCausalLM(torch.nn.Module):
    """A transformers decoder-only LM whose ``generate``, ``generate_batch`` and ``stream`` run on torchspec's
    engine, and which is the model everywhere else a client looks (pipelines, lm-eval, trainers).

    torchspec's own: ``generate``, ``generate_batch``, ``stream``, ``forward`` (calls the model), ``engine``,
    ``last_stats``, ``spec_config``, ``tokenizer``, ``layers``, ``tensor_parallel`` (the group the model is sharded
    over, or None) and ``hf_model`` (the wrapped model). The rest
    is the model's:

    - an attribute the wrapper does not define is read from the model (``__getattr__``) and assigned on it,
      so ``config``, ``generation_config``, ``dtype``, ``device``, ``can_generate``, ``save_pretrained``,
      ``gradient_checkpointing_enable``, ``get_output_embeddings``, ``base_model``, ``add_model_tags``, ...
      are the model's own, and an assigned ``generation_config`` is the one ``generate`` reads;
    - its nn.Module state is the model's (the same dicts): the same parameters (weights shared by reference),
      submodules and names, hence the same ``state_dict`` and ``load_state_dict``; ``training`` is the
      model's flag, and the Module methods transformers redefines (``to``, ``cuda``, ``half``, ``float``,
      ``train``, ``eval``) run the model's version and return the wrapper;
    - ``isinstance`` and class-name checks see the model's class (``__class__`` reports it, as
      ``wrapt.ObjectProxy`` does), so ``isinstance(wrapped, PreTrainedModel)`` holds; ``type(wrapped)`` is
      SparseSpecForCausalLM.

    Why delegation rather than patching the model in place and returning it: one model backs several
    wrappers with different options (``draft=None`` next to a draft policy, as the benchmarks and lossless
    tests do), and the model keeps transformers' own ``generate``, the reference torchspec is checked
    against. A class swapped in place would give every wrap of a model one engine and configuration and take
    that reference away. torchspec routes attention to its paged ops only while its engine runs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: SpecConfig,
        tokenizer: Any = None,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.hf_model = model  # not a submodule: the wrapper shares the model's
        for name in _SHARED_MODULE_STATE:
            object.__setattr__(self, name, getattr(model, name))
        del self.__dict__["training"]  # read through to the model's flag
        self.tensor_parallel = tensor_parallel  # the group ``model`` is sharded over (sparsespec.wrap)
        self.spec_config = config
        self.tokenizer = tokenizer
        self._tokenizer_searched = tokenizer is not None
        self.layers = probe_attention_layers(model)
        # Refuse a bad pairing now, not at first use.
        draft_chain = use_draft_chain(config.draft_chain, POLICIES.get(config.draft), config.unified_schedule)
        use_adaptive_rounds(config.adaptive_rounds, draft_chain)
        self.last_stats = GenerationStats()
        self._engine: Engine | None = None

    # -- the model everywhere else ---------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """An attribute the wrapper does not define is the model's (submodules resolve first: they are shared)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if (name.startswith("__") and name.endswith("__")) or "hf_model" not in self.__dict__:
                raise
            return getattr(self.hf_model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assigning an attribute of the model's (one the wrapper does not define) assigns it on the model, so
        that reads through the wrapper, and the model's own methods, see the new value. torchspec's own
        attributes are plain ones, never entries of the (shared) module tree."""
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        elif name not in self.__dict__ and not hasattr(type(self), name) and hasattr(self.hf_model, name):
            setattr(self.hf_model, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def __class__(self) -> type:
        """The model's class, for the isinstance and class-name checks of pipelines and trainers."""
        return type(self.hf_model)

    def __reduce_ex__(self, protocol: object) -> tuple:
        """Pickle and deepcopy by the real type (pickle refuses an object whose ``__class__`` differs). A copy
        builds its own engine when first used: the KV pool and captured graphs are not copied."""
        return object.__new__, (type(self),), {**self.__dict__, "_engine": None}

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.hf_model)))

    def _get_name(self) -> str:  # the name nn.Module's repr shows: say it is wrapped
        return type(self).__name__

    # nn.Module methods that transformers' PreTrainedModel redefines (quantized-model checks, kernel modes).
    to = _model_method("to")
    cuda = _model_method("cuda")
    half = _model_method("half")
    float = _model_method("float")
    train = _model_method("train")
    eval = _model_method("eval")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's own forward (its original attention implementation)."""
        return self.hf_model(*args, **kwargs)

    @property
    def engine(self) -> Engine:
        """The engine, with its KV pool allocated on first use and kept for later calls."""
        if self._engine is None:
            self._engine = Engine(self.hf_model, self.spec_config, self.layers, tensor_parallel=self.tensor_parallel)
        return self._engine

    # -- generate --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        streamer: BaseStreamer | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """Like transformers' ``generate`` for decoder-only models, on a (left-)padded ``[B, S]`` batch.

        Returns ``[B * num_return_sequences, S + n]`` token ids (each prompt's samples in consecutive rows, finished
        rows padded with ``pad_token_id``; ``n`` is the longest generation), or a ``GenerateDecoderOnlyOutput``
        when ``return_dict_in_generate=True``. A prompt's samples prefill it once (see torchspec/scheduler.py).
        ``streamer`` gets the input rows, then each column of new tokens as every row has committed it, then
        ``end()``, as transformers calls it (torchspec/streamer.py).

        ``stopping_criteria`` and ``stop_strings`` (with ``tokenizer=``, or the one given to ``wrap``) stop each
        row as transformers does, token for token: the criteria are checked on the host as a row's tokens are
        committed, on the whole batch, each row its input (its padding included) and the tokens generated so
        far, with ``scores=None`` (see torchspec/stopping.py). Rows advance at their own pace, so a criterion
        that answers for the whole batch (lm-eval's) may stop a row a few tokens from where transformers would.
        """
        input_ids = kwargs.pop("inputs", input_ids)
        if input_ids is None:
            raise ValueError("generate needs `input_ids` ([batch, seq] token ids)")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("`input_ids` must be a 2-D tensor [batch, seq]; tokenize with return_tensors='pt'")
        resolved = resolve_generation_config(self.hf_model, generation_config, kwargs, self.tokenizer)
        if attention_mask is None:
            attention_mask = infer_attention_mask(input_ids, resolved)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
            )
        # As transformers: a prompt's samples are consecutive rows (prompt 0 n times, then prompt 1 ...).
        input_ids = input_ids.repeat_interleave(resolved.num_return_sequences, dim=0)
        attention_mask = attention_mask.repeat_interleave(resolved.num_return_sequences, dim=0)
        max_new_tokens, min_new_tokens = resolved.lengths_for(self.hf_model, input_ids.shape[1])
        params = resolved.sampling_params(max_new_tokens, min_new_tokens)
        engine = self.engine
        fill = resolved.pad_token_id if resolved.pad_token_id is not None else 0
        # The criteria see the batch as transformers does: each input row (with its padding), then its new tokens.
        criteria = None
        if params.stopping_criteria is not None:
            criteria = CriteriaBatch(input_ids.cpu().tolist(), max_new_tokens, pad_token_id=fill)
        requests = []
        for row, (ids, mask) in enumerate(zip(input_ids.cpu(), attention_mask.cpu().bool(), strict=True)):
            first = row - row % resolved.num_return_sequences
            if row > first:  # a further sample of the prompt above: it copies the first's prompt K/V
                requests.append(requests[first].fork(row, criteria_row=row))
                continue
            prompt = ids[mask].tolist()
            try:
                engine.check_request(prompt, params)
            except ValueError as error:
                raise ValueError(f"batch row {row}: {error}") from None
            requests.append(
                Request(request_id=row, prompt_ids=prompt, params=params, criteria=criteria, criteria_row=row)
            )
        on_step = None
        if streamer is not None:
            streamer.put(input_ids.cpu())
            on_step = StreamedColumns(streamer, requests, fill)
        self.last_stats = engine.run(requests, on_step=on_step)
        if streamer is not None:
            streamer.end()
        failed = [r for r in requests if r.finish_reason is FinishReason.ERROR]
        if failed:
            raise RuntimeError(f"generation failed for batch row {failed[0].request_id}: {failed[0].error}")
        width = max(r.num_output_tokens for r in requests)
        generated = torch.full((len(requests), width), fill, dtype=input_ids.dtype)
        for row, request in enumerate(requests):
            generated[row, : request.num_output_tokens] = torch.tensor(request.output_ids, dtype=input_ids.dtype)
        sequences = torch.cat([input_ids, generated.to(input_ids.device)], dim=1)
        if resolved.config.return_dict_in_generate:
            scores, logits = (_per_step(requests, name, width, sequences.device) for name in ("scores", "raw_logits"))
            return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)
        return sequences

    # -- generate_batch ----------------------------------------------------------------------------------
    def _requests_for(
        self, inputs: Sequence[str | Sequence[int]], generation_config: GenerationConfig | None, kwargs: dict
    ) -> list[list[Request]]:
        """Per input, its ``num_return_sequences`` requests: the first prefills the prompt, the others copy its K/V
        (``Request.fork``). A bad input comes back as that many requests finished with its error."""
        resolved = resolve_generation_config(self.hf_model, generation_config, kwargs, self.tokenizer)
        resolved.sampling_params(0, 0).validate()  # call-wide values (temperature, top-p...) fail the call
        engine = self.engine
        groups = []
        for index, item in enumerate(inputs):
            try:
                prompt = self._tokenize(item)
                params = resolved.sampling_params(*resolved.lengths_for(self.hf_model, len(prompt)))
            except ValueError as error:
                request = Request(request_id=index, prompt_ids=[], params=resolved.sampling_params(0, 0))
                request.finish(FinishReason.ERROR, str(error))
            else:
                request = engine.new_request(index, prompt, params)
            groups.append([request, *(request.fork(index) for _ in range(resolved.num_return_sequences - 1))])
        return groups

    @torch.inference_mode()
    def generate_batch(
        self,
        inputs: Sequence[str | Sequence[int]],
        generation_config: GenerationConfig | None = None,
        progress_bar: bool = True,
        *,
        continuous_batching_config: Any = None,
        record_timestamps: bool = False,
        persistent_manager: bool = False,
        warmup: bool = True,
        **kwargs: Any,
    ) -> dict[str, RequestOutput]:
        """Generate for a list of prompts of any lengths (token id lists, or strings with a tokenizer) with
        continuous batching. Returns what transformers' ``generate_batch`` returns, so its callers run
        unchanged: one output per input keyed by its request id (``"req_0"``, ``"req_1"``, ...), in input
        order, each with ``generated_tokens``; ``list(result.values())`` is the list of :class:`RequestOutput`.
        With ``num_return_sequences=n`` an input's n samples are keyed as transformers keys them, its children
        first (``"req_0__child#0"`` ... ``"req_0__child#{n-2}"``), then ``"req_0"``; they prefill the prompt once.
        A bad prompt is reported in its output(s) (``finish_reason="error"``) and the others complete.

        transformers' own arguments are accepted: ``continuous_batching_config`` sizes and schedules
        transformers' manager, which torchspec's engine does from ``wrap()``'s options instead (its
        ``return_logprobs`` and ``seed``, which would change the outputs, are refused); ``persistent_manager``
        and ``warmup`` ask for nothing here (the engine persists and captures graphs as it goes);
        ``record_timestamps=True`` is refused (the engine does not time each token)."""
        if isinstance(inputs, (str, torch.Tensor)) or not isinstance(inputs, Sequence):
            raise TypeError("generate_batch takes a list of prompts (strings or token id lists)")
        if record_timestamps:
            raise ValueError("generate_batch option `record_timestamps` is not supported by torchspec")
        for name, off in (("return_logprobs", False), ("seed", None)):
            if getattr(continuous_batching_config, name, off) != off:
                raise ValueError(f"continuous_batching_config.{name} is not supported by torchspec")
        groups = self._requests_for(inputs, generation_config, dict(kwargs))
        requests = [request for group in groups for request in group]
        with tqdm(total=len(requests), unit="req", disable=not progress_bar, desc="generate") as bar:
            bar.update(sum(r.is_finished for r in requests))
            start = time.perf_counter()

            shown = start  # when the rate was last shown

            def on_step(plan: StepPlan, finished: list[Request]) -> None:
                nonlocal shown
                now = time.perf_counter()
                if now - shown >= PROGRESS_SECONDS:  # a count over every request, not paid at every step
                    generated = sum(r.num_output_tokens for r in requests)
                    # Shown now: once a request has finished, tqdm redraws only when the count moves.
                    bar.set_postfix_str(f"{generated} tok, {generated / (now - start):.1f} tok/s", refresh=True)
                    shown = now
                bar.update(len(finished))

            self.last_stats = self.engine.run(requests, on_step=on_step)
        # transformers lists an input's samples as its children, then the parent: the one the others copied from.
        outputs = (self._output(r, child) for group in groups for child, r in [*enumerate(group[1:]), (None, group[0])])
        return by_request_id(outputs)

    @torch.inference_mode()
    def stream(
        self, prompt: str | Sequence[int], generation_config: GenerationConfig | None = None, **kwargs: Any
    ) -> Iterator[list[int]]:
        """Generate for one prompt, yielding the new token ids of each step as they are produced."""
        ((request, *samples),) = self._requests_for([prompt], generation_config, dict(kwargs))
        if samples:
            raise ValueError("stream() makes one sample of its prompt: use generate or generate_batch for several")
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
                self.tokenizer, self._tokenizer_searched = find_tokenizer(self.hf_model), True
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

    def _output(self, request: Request, child: int | None = None) -> RequestOutput:
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
            child=child,
        )


def _per_step(
    requests: Sequence[Request], name: str, width: int, device: torch.device
) -> tuple[torch.Tensor, ...] | None:
    """transformers' ``scores`` or ``logits`` of ``generate`` (``name``: the requests' kept rows, see
    ``SamplingParams.output_scores``): one ``[rows, V]`` fp32 tensor per generated position; a row past its own
    sequence's end holds ``-inf`` (transformers would score the padding it feeds there). None when not kept."""
    kept = [torch.cat(getattr(request, name)) if getattr(request, name) else None for request in requests]
    present = [rows for rows in kept if rows is not None]
    if not present:
        return None
    table = torch.full((len(requests), width, present[0].shape[-1]), float("-inf"))
    for row, rows in enumerate(kept):
        if rows is not None:
            table[row, : rows.shape[0]] = rows
    return tuple(table.to(device).unbind(1))
