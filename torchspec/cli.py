"""Command line: ``torchspec generate "prompt"`` and ``torchspec bench`` (or ``python -m torchspec ...``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from torchspec import sparsespec
from torchspec.arguments import add_device_arguments, at_least, model_dtype
from torchspec.bench import suite
from torchspec.causal_lm import RequestOutput, SparseSpecForCausalLM
from torchspec.config import DEFAULT_DRAFT, DRAFT_POLICIES
from torchspec.models import DEFAULT_MODEL_NAME, load_model
from torchspec.parallel import init_distributed, launched_rank, launched_world_size, rank_device
from torchspec.parallel.replicas import generate_replicated
from torchspec.workloads import chat_token_ids, read_prompts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchspec", description="Sparse self-speculative decoding for HF LMs")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="answer one prompt (streamed) or a file of prompts (batched)")
    gen.add_argument("prompt", nargs="?", help="the prompt; omit it to use --prompts-file")
    gen.add_argument("--prompts-file", help="a .jsonl file (field 'prompt') or text file (one a line)")
    gen.add_argument("--reasoning-prompts", action="store_true", help="use the packaged AIME/OlympiadBench prompts")
    gen.add_argument("--limit", type=at_least(1), help="use the first N prompts of the file")
    gen.add_argument("--model", help=f"local HF directory or .gguf file (default: embedded {DEFAULT_MODEL_NAME})")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=at_least(0.0, float), default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument(
        "--draft",
        default=DEFAULT_DRAFT,
        choices=["none", *DRAFT_POLICIES],
        help=f"draft policy, or none for plain decoding (default: {DEFAULT_DRAFT})",
    )
    gen.add_argument("--max-batch-size", type=int, default=256)
    gen.add_argument("--system", help="system message for the chat template")
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt text as is")
    add_device_arguments(gen)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--tp",
        type=at_least(1),
        default=1,
        help="tensor-parallel size under torchrun: shard the model over this many ranks; the launch's "
        "WORLD_SIZE / tp replicas split the prompts (default 1)",
    )
    gen.add_argument("--output", help="write one JSON line per prompt to this file")
    bench = commands.add_parser(
        "bench",
        help="measure methods (ours with each draft policy, transformers' peers) on one workload; write a report",
        description=suite.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    suite.add_arguments(bench)
    return parser


def _generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompts_file is None and not args.reasoning_prompts):
        print("error: give a prompt or --prompts-file / --reasoning-prompts (one of them)", file=sys.stderr)
        return 2
    if args.temperature == 0 and (args.top_p != 1.0 or args.top_k != 0):
        print("note: --top-p/--top-k apply only when sampling (--temperature > 0)", file=sys.stderr)
    if args.prompt is None:
        texts = read_prompts(None if args.reasoning_prompts else args.prompts_file, args.limit)
    else:
        texts = [args.prompt]
    with contextlib.ExitStack() as stack:
        # Open the output first: a bad path fails now, not after the whole generation. Rank 0 reports for all.
        report = launched_rank() == 0
        sink = stack.enter_context(open(args.output, "w")) if args.output and report else None
        model, tokenizer = _load(args)
        prompts = [
            tokenizer(text, add_special_tokens=False)["input_ids"]
            if args.no_chat_template
            else chat_token_ids(tokenizer, text, args.system)
            for text in texts
        ]
        sampling: dict = {"max_new_tokens": args.max_new_tokens, "do_sample": args.temperature > 0}
        if args.temperature > 0:
            sampling.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        if args.prompt is not None and args.output is None and launched_world_size() == 1:
            _stream(model, tokenizer, prompts[0], sampling)
        else:
            outputs = generate_replicated(model, prompts, progress_bar=report, **sampling)
            for text, output in zip(texts, outputs.values(), strict=True):
                if sink is not None:
                    sink.write(json.dumps(_record(text, output)) + "\n")
                elif not report:
                    continue
                elif output.error:
                    print(f"[{output.index}] error: {output.error}")
                else:
                    print(f"[{output.index}] {output.text}\n")
    if report:
        print(model.last_stats.summary(), file=sys.stderr)
    return 0


def _load(args: argparse.Namespace) -> tuple[SparseSpecForCausalLM, Any]:
    dtype = model_dtype(args.dtype, args.device)
    torch.manual_seed(args.seed)
    device = rank_device(args.device)
    if launched_world_size() > 1:  # torchrun: replicas (and tensor-parallel groups) of one world
        init_distributed(device, "a torchrun launch")
    hf_model, tokenizer = load_model(args.model, dtype=dtype, device=device)
    model = sparsespec.wrap(
        hf_model,
        tokenizer=tokenizer,
        draft=None if args.draft == "none" else args.draft,
        max_batch_size=args.max_batch_size,
        tensor_parallel_size=args.tp,
    )
    return model, tokenizer


def _stream(model: SparseSpecForCausalLM, tokenizer: Any, prompt: list[int], sampling: dict) -> None:
    """Print the answer as it is generated (decoding the whole text each time keeps multi-token characters)."""
    generated: list[int] = []
    printed = ""
    for new_tokens in model.stream(prompt, **sampling):
        generated.extend(new_tokens)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        print(text[len(printed) :], end="", flush=True)
        printed = text
    print()


def _record(prompt: str, output: RequestOutput) -> dict:
    return {
        "prompt": prompt,
        "answer": output.text,
        "finish_reason": output.finish_reason,
        "error": output.error,
        "generated_tokens": output.stats.generated_tokens,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return suite.main(args) if args.command == "bench" else _generate(args)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
