"""transformers' GenerationConfig semantics: merge order, lengths, EOS/pad, and what torchspec refuses.

The merge and length rules are transformers' own methods, called on the wrapped model, so precedence
(kwargs / generation_config > model.generation_config > global defaults) is exactly what users know.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from torchspec.request import SamplingParams

# GenerationConfig fields torchspec does not implement, with the values that mean "off", by why each is refused.
_REFUSED: dict[str, dict[str, tuple[Any, ...]]] = {
    "another search: torchspec decodes one sequence per request, which speculation verifies": {
        "num_beams": (None, 1),
        "num_beam_groups": (None, 1),
        "diversity_penalty": (None, 0.0),
        "constraints": (None,),
        "force_words_ids": (None,),
        "penalty_alpha": (None,),
        "dola_layers": (None,),
        "guidance_scale": (None, 1.0),
    },
    "another speculation method: torchspec drafts with the model itself": {
        "prompt_lookup_num_tokens": (None,),
        "assistant_early_exit": (None,),
        "use_mtp": (None, False),
    },
    "a logits processor not applied yet (it must act alike in drafts and verifies to keep sampling exact)": {
        "encoder_repetition_penalty": (None, 1.0),
        "no_repeat_ngram_size": (None, 0),
        "encoder_no_repeat_ngram_size": (None, 0),
        "bad_words_ids": (None,),
        "sequence_bias": (None,),
        "top_h": (None,),
        "typical_p": (None, 1.0),
        "epsilon_cutoff": (None, 0.0),
        "eta_cutoff": (None, 0.0),
        "suppress_tokens": (None,),
        "begin_suppress_tokens": (None,),
        "forced_bos_token_id": (None,),
        "forced_eos_token_id": (None,),
        "exponential_decay_length_penalty": (None,),
        "renormalize_logits": (None, False),
        "remove_invalid_values": (None, False),
        "watermarking_config": (None,),
    },
    "not made by torchspec's paged forwards (attention weights, hidden states, prompt re-tokenising, time limits)": {
        "output_attentions": (None, False),
        "output_hidden_states": (None, False),
        "token_healing": (None, False),
        "max_time": (None,),
    },
}
_OFF_VALUES = {name: off for options in _REFUSED.values() for name, off in options.items()}


# generate() arguments outside GenerationConfig that torchspec does not implement. Clients pass some of them
# with values that ask for nothing (a trainer's `synced_gpus=False`, an empty `LogitsProcessorList`): those are
# accepted. (`streamer` is generate's own argument; generate_batch and stream refuse one as an unknown argument.)
UNSUPPORTED_GENERATE_ARGS = (
    "logits_processor",
    "prefix_allowed_tokens_fn",
    "assistant_model",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "synced_gpus",
    "inputs_embeds",
)
# generate() arguments that serve only options refused on their own (the assistant model's tokenizer, remote
# code for custom_generate): ignored.
_HELPER_GENERATE_ARGS = ("assistant_tokenizer", "trust_remote_code")


def _asks_for_nothing(value: Any) -> bool:
    """None, False or an empty list (a LogitsProcessorList or StoppingCriteriaList with nothing in it)."""
    return value is None or value is False or (isinstance(value, list) and not value)


@dataclass(frozen=True)
class ResolvedGeneration:
    """A merged GenerationConfig turned into what the engine needs."""

    config: GenerationConfig
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    has_default_max_length: bool
    has_default_min_length: bool
    # transformers' criteria for the call (``stopping_criteria`` and those ``stop_strings`` make), None when none.
    stopping_criteria: StoppingCriteriaList | None = None
    num_return_sequences: int = 1  # samples per prompt

    def sampling_params(self, max_new_tokens: int, min_new_tokens: int) -> SamplingParams:
        config = self.config
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=bool(config.do_sample),
            temperature=1.0 if config.temperature is None else float(config.temperature),
            top_k=config.top_k or 0,
            top_p=1.0 if config.top_p is None else float(config.top_p),
            repetition_penalty=1.0 if config.repetition_penalty is None else float(config.repetition_penalty),
            min_p=0.0 if config.min_p is None else float(config.min_p),
            stop_token_ids=self.eos_token_ids,
            stopping_criteria=self.stopping_criteria,
            output_scores=bool(config.return_dict_in_generate and config.output_scores),
            output_logits=bool(config.return_dict_in_generate and config.output_logits),
        )

    def lengths_for(self, model: Any, input_length: int) -> tuple[int, int]:
        """(max_new_tokens, min_new_tokens) for a prompt of ``input_length`` tokens, as transformers derives
        them from max_new_tokens / max_length / min_new_tokens / min_length."""
        config = copy.deepcopy(self.config)
        model._prepare_generated_length(
            config, self.has_default_max_length, self.has_default_min_length, "input_ids", input_length, None
        )
        model._validate_generated_length(config, input_length, self.has_default_max_length)
        return config.max_length - input_length, max(0, (config.min_length or 0) - input_length)


def resolve_generation_config(
    model: Any, generation_config: GenerationConfig | None, kwargs: dict[str, Any], tokenizer: Any = None
) -> ResolvedGeneration:
    """Merge like transformers' ``generate`` and refuse, by name, every option torchspec cannot honour.
    ``tokenizer`` (the wrapper's) makes the criteria of ``stop_strings`` when the call passes none."""
    for name in UNSUPPORTED_GENERATE_ARGS:
        if not _asks_for_nothing(kwargs.pop(name, None)):
            raise ValueError(f"generate option `{name}` is not supported by torchspec")
    for name in _HELPER_GENERATE_ARGS:
        kwargs.pop(name, None)
    custom_criteria = kwargs.pop("stopping_criteria", None)
    passed_tokenizer = kwargs.pop("tokenizer", None)
    tokenizer = tokenizer if passed_tokenizer is None else passed_tokenizer
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None and k != "use_cache"}
    if model_kwargs:
        raise ValueError(f"unsupported generate argument(s) {sorted(model_kwargs)}")
    enabled = [name for name, off in _OFF_VALUES.items() if getattr(config, name, None) not in off]
    if enabled:
        why = "; ".join(
            f"{', '.join(names)}: {reason}"
            for reason, options in _REFUSED.items()
            if (names := [name for name in options if name in enabled])
        )
        raise ValueError(
            f"generation option(s) {enabled} are not supported by torchspec ({why}); unset them "
            "(supported: max_new_tokens, max_length, min_new_tokens, min_length, do_sample, temperature, top_k, "
            "top_p, min_p, repetition_penalty, eos_token_id, pad_token_id, stop_strings, stopping_criteria, "
            "num_return_sequences, return_dict_in_generate with output_scores and output_logits, streamer)"
        )
    samples = 1 if config.num_return_sequences is None else config.num_return_sequences
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(
            f"num_return_sequences must be an integer >= 1 (the samples generated per prompt), got {samples!r}; "
            "pass e.g. num_return_sequences=4 with do_sample=True"
        )
    eos = config.eos_token_id
    listed = () if eos is None else (int(t) for t in ([eos] if isinstance(eos, int) else eos))
    # A negative id is no token: transformers' generate_batch writes -1 ("no EOS") into the config it runs on (the
    # one passed, else the model's), and generate never stops on one. Kept, it would index the logits at -1.
    eos_token_ids = tuple(t for t in listed if t >= 0)
    pad_token_id = config.pad_token_id
    if pad_token_id is None and eos_token_ids:
        warnings.warn(
            f"Setting `pad_token_id` to `eos_token_id`:{eos_token_ids[0]} for open-end generation.", stacklevel=3
        )
        pad_token_id = eos_token_ids[0]
    criteria = _stopping_criteria(model, config, custom_criteria, tokenizer)
    return ResolvedGeneration(
        config, eos_token_ids, pad_token_id, has_default_max_length, has_default_min_length, criteria, samples
    )


def _stopping_criteria(
    model: Any, config: GenerationConfig, custom: StoppingCriteriaList | StoppingCriteria | None, tokenizer: Any
) -> StoppingCriteriaList | None:
    """The criteria transformers' ``generate`` would check, less those the engine enforces itself (max length,
    EOS): a ``StopStringCriteria`` for ``stop_strings``, built as transformers builds it, merged with the
    caller's ``stopping_criteria`` by transformers' own rule (a caller's criterion of the same type wins)."""
    made = StoppingCriteriaList()
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError(
                "`stop_strings` need the model's tokenizer to find them in the generated tokens: pass "
                "`tokenizer=` to generate (as transformers asks) or to sparsespec.wrap()"
            )
        made.append(StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer))
    if callable(custom) and not isinstance(custom, list):  # one criterion, not in a list
        custom = [custom]
    criteria = model._merge_criteria_processor_list(made, StoppingCriteriaList(custom or ()))
    return criteria or None


def infer_attention_mask(input_ids: torch.Tensor, resolved: ResolvedGeneration) -> torch.Tensor:
    """transformers' rule: padding is known from pad_token_id only when it differs from every EOS id."""
    pad = resolved.pad_token_id
    if pad is not None and bool((input_ids == pad).any()) and pad not in resolved.eos_token_ids:
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)
