"""Argument types shared by the command-line tools: refusing a bad value at parse time, before a model loads."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch


def at_least(minimum: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type accepting numbers of ``kind`` that are >= ``minimum``."""

    def parse(text: str):
        value = kind(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    return parse


def torch_device(text: str) -> torch.device:
    """An argparse type: cpu, cuda[:N] or auto (cuda when this torch sees one)."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(text)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu, cuda or auto") from error
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("--device cuda, but this torch sees no CUDA device")
    return parsed


def model_dtype(name: str, target: torch.device) -> str:
    """``--dtype``'s value: ``auto`` is bf16 on a GPU and fp32 on a CPU (where bf16 matmuls are slow)."""
    if name != "auto":
        return name
    return "bfloat16" if target.type == "cuda" else "float32"


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--device``, as every command that loads a model takes them."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bf16 on GPU, fp32 on CPU",
    )
    parser.add_argument("--device", type=torch_device, default="auto", help="cpu or cuda (auto: cuda when available)")
