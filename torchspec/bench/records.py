"""What every benchmark shares: the model/device/engine arguments, the environment fields of a record, and
appending records as JSON lines (so runs on different machines merge into one file)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from attention import BACKENDS

DTYPES = ["float32", "bfloat16", "float16"]


def add_model_arguments(parser: argparse.ArgumentParser, dtype: str = "bfloat16") -> None:
    parser.add_argument("--model", help="local HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default=dtype, choices=DTYPES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", action="store_true", help="torch.compile the model forward")
    parser.add_argument("--cuda-graphs", action="store_true", help="replay decoding steps from CUDA graphs")
    parser.add_argument("--attention-backend", default="auto", choices=BACKENDS, help="attention op set")
    parser.add_argument("--no-draft-chain", action="store_true", help="one draft per engine step (draft_chain=False)")


def engine_options(args: argparse.Namespace) -> dict[str, bool | str | None]:
    """``wrap()`` options from :func:`add_engine_arguments` (None = the engine's default)."""
    options = {"compile": args.compile or None, "cuda_graphs": args.cuda_graphs or None}
    if args.no_draft_chain:
        options["draft_chain"] = False
    if args.attention_backend != "auto":
        options["attention_backend"] = args.attention_backend
    return options


def environment(device: torch.device | str, dtype: torch.dtype | str) -> dict[str, str]:
    """The machine fields of a record: GPU name (or cpu), dtype, torch version."""
    name = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"
    return {"device": name, "dtype": str(dtype), "torch": torch.__version__}


def append_record(path: str | None, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` (nothing when no path was given)."""
    if path:
        with open(path, "a") as sink:
            sink.write(json.dumps(record) + "\n")
