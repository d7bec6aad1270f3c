"""What every benchmark shares: the model/device/engine arguments, the environment fields of a record, and
appending records as JSON lines (so runs on different machines merge into one file)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from attention import BACKENDS
from torchspec.config import DRAFT_POLICIES, SpecConfig

DTYPES = ["float32", "bfloat16", "float16"]


def add_model_arguments(parser: argparse.ArgumentParser, dtype: str = "bfloat16") -> None:
    parser.add_argument("--model", help="local HF directory or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default=dtype, choices=DTYPES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


SWITCHES = {"auto": None, "on": True, "off": False}  # a tri-state wrap() option on the command line
#: wrap() options a benchmark can set, each ``--NAME auto|on|off`` (``--NAME`` alone: on; auto: the default).
ENGINE_SWITCHES = {
    "compile": "torch.compile the model forward (auto: off)",
    "cuda_graphs": "replay decoding steps from CUDA graphs (auto: on with CUDA)",
    "delayed_verify": "launch each step before reading the last one back; with speculation the batch's halves "
    "alternate (auto: on without speculation)",
    "draft_chain": "a request drafts its whole round in one engine step (auto: where the policy allows)",
    "adaptive_rounds": "choose each step's round length from measured costs (auto: off)",
    "fuse_layers": "one GEMM for q/k/v and gate/up, one kernel per norm, RoPE, SiLU x mul (auto: on)",
    "unified_schedule": "spread the requests' rounds over a round's phases, one forward per step (auto: off)",
    "offload": "admit requests by the KV they hold and move the newest to host memory when the pool is short "
    "(auto: off)",
    "budget_by_misses": "weigh each request's draft budget by the drafts its recent rounds rejected (auto: on with "
    "CUDA, except query_sketch)",
}


#: Numeric wrap() options a setting may give (``+NAME=VALUE``), with their types.
ENGINE_VALUES: dict[str, type] = {
    "k": int,
    "sparsity": float,
    "min_budget": int,
    "recent_window": int,
    "successors": int,
    "sketch_shortlist": int,
    "relearn_rounds": int,
    "draft_step_budget": int,
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    for name, meaning in ENGINE_SWITCHES.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, nargs="?", const="on", default="auto", choices=list(SWITCHES), help=meaning)
    parser.add_argument("--attention-backend", default="auto", choices=BACKENDS, help="attention op set")


def parse_setting(text: str) -> tuple[str | None, dict[str, bool | int | float]]:
    """A run of ours by its setting: a draft policy (or ``none``), then engine switches turned on (``+name``) or
    off (``-name``) and numeric options set (``+name=VALUE``, one of ``ENGINE_VALUES``) for that run alone, e.g.
    ``pillar_recent+compile-adaptive_rounds+k=4+sparsity=0.1``: one command runs an ablation or a sweep of k and
    sparsity. The values are checked as ``wrap()`` checks them, so a bad one is refused before a model loads."""
    draft, *switches = re.split(r"(?=[+-])", text)
    if draft not in ("none", *DRAFT_POLICIES):
        raise argparse.ArgumentTypeError(f"unknown draft {draft!r} in {text!r}; use none or one of {DRAFT_POLICIES}")
    overrides: dict[str, bool | int | float] = {}
    for switch in switches:
        name, is_value, value = switch[1:].partition("=")
        if is_value:
            overrides[name] = _engine_value(switch, name, value, text)
            continue
        if name not in ENGINE_SWITCHES:
            raise argparse.ArgumentTypeError(f"unknown switch {name!r} in {text!r}; use one of {list(ENGINE_SWITCHES)}")
        overrides[name] = switch[0] == "+"
    draft = None if draft == "none" else draft
    try:
        SpecConfig(draft=draft, **overrides)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error} (in {text!r})") from None
    return draft, overrides


def record_setting(record: dict[str, Any]) -> str:
    """The setting a throughput record ran (``parse_setting``'s text): its ``setting``, or for records written before
    they kept one, its draft."""
    return record.get("setting") or str(record.get("draft"))


def _engine_value(switch: str, name: str, value: str, text: str) -> int | float:
    """The value of ``+NAME=VALUE`` as its option's type (``ENGINE_VALUES``)."""
    kind = ENGINE_VALUES.get(name)
    try:
        if switch[0] == "+" and kind is not None:
            return kind(value)
    except ValueError:
        pass
    options = ", ".join(f"{option} ({kind.__name__})" for option, kind in ENGINE_VALUES.items())
    raise argparse.ArgumentTypeError(
        f"bad option {switch!r} in {text!r}; set a number as +NAME=VALUE, NAME one of {options}"
    )


def engine_options(args: argparse.Namespace) -> dict[str, bool | str | None]:
    """``wrap()`` options from :func:`add_engine_arguments`; the ones left at auto are not passed."""
    options: dict[str, bool | str | None] = {
        name: SWITCHES[getattr(args, name)] for name in ENGINE_SWITCHES if getattr(args, name) != "auto"
    }
    if args.attention_backend != "auto":
        options["attention_backend"] = args.attention_backend
    return options


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | str, dtype: torch.dtype | str) -> dict[str, str | None]:
    """The machine fields of a record: GPU name (or cpu), dtype, the torch, transformers and triton versions (None
    where one is not installed), torch's CPU threads and the CPU's load (1-minute average, this process's own work
    included): other work on the CPU slows every method, a speculative step most. And the tree measured
    (``source_tree``, and ``content_tree_id`` for a copy whose git history lags its files), so a record names the
    code that produced it."""
    name = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"
    return {
        "tree": source_tree(),
        "tree_id": content_tree_id(),
        "device": name,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
    }


def source_tree() -> str | None:
    """The commit of the torchspec checkout running, ``-dirty`` appended when tracked files differ from it (an
    uncommitted change under measurement); None outside a git checkout (an installed wheel)."""
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if described.returncode != 0:
        return None
    return described.stdout.strip() or None


def content_tree_id(root: Path | None = None) -> str | None:
    """The git tree id of the checkout's files as they are (tracked and untracked, less what git ignores): what
    ``git add -A && git write-tree`` would give, computed without writing to the repository. It names the code even
    where the checkout's history lags its files (the GPU machine's copy of a working tree: its ``source_tree`` read
    an older commit plus ``-dirty``); ``git log --format='%h %T'`` finds the commit with that tree. None outside a
    git checkout."""
    root = root or Path(__file__).resolve().parent
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
        if top.returncode != 0:
            return None
        top_dir = Path(top.stdout.strip())
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=top_dir, capture_output=True
        )
    except OSError:
        return None
    if listed.returncode != 0:
        return None
    tree: dict = {}
    for name in sorted(set(listed.stdout.decode().split("\0")) - {""}):
        path = top_dir / name
        if not path.is_symlink() and not path.is_file():  # tracked, deleted since: ``git add -A`` drops it
            continue
        if path.is_symlink():
            mode, data = "120000", os.readlink(path).encode()
        else:
            mode, data = ("100755" if os.access(path, os.X_OK) else "100644"), path.read_bytes()
        *folders, leaf = name.split("/")
        node = tree
        for folder in folders:
            node = node.setdefault(folder, {})
        node[leaf] = (mode, _git_object("blob", data))
    return _tree_object(tree).hex()


def _git_object(kind: str, body: bytes) -> bytes:
    """The binary id git gives an object of ``kind`` holding ``body``."""
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).digest()


def _tree_object(node: dict) -> bytes:
    """The id of a tree of ``node`` (name -> (mode, blob id) or a sub-tree), entries in git's order (a folder's
    name sorts as if it ended with ``/``)."""
    entries = []
    for name, value in node.items():
        mode, ident = ("40000", _tree_object(value)) if isinstance(value, dict) else value
        entries.append((name + "/" if isinstance(value, dict) else name, f"{mode} {name}".encode() + b"\0" + ident))
    return _git_object("tree", b"".join(entry for _, entry in sorted(entries, key=lambda item: item[0].encode())))


def append_record(path: str | None, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` (nothing when no path was given)."""
    if path:
        with open(path, "a") as sink:
            sink.write(json.dumps(record) + "\n")


class KernelCompiles:
    """Triton kernels compiled (or loaded from Triton's disk cache) while it is active: ``events`` holds
    ``(seconds since start, seconds taken, kernel: its cache key)`` in order. A run that compiles a
    kernel variant mid-run pays ~1 s a variant where the step takes milliseconds; this names which variant."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, str]] = []
        self._started: dict[Any, float] = {}
        self._start = 0.0

    def __enter__(self) -> KernelCompiles:
        from triton import knobs

        self._runtime = knobs.runtime
        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        self._start = time.perf_counter()
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._miss, self._compiled
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._saved

    def _miss(self, **info: Any) -> bool:
        self._started[str(info.get("key"))] = time.perf_counter()
        return False  # compile as usual

    def _compiled(self, **info: Any) -> bool:
        now = time.perf_counter()
        key = str(info.get("key"))
        began = self._started.pop(key, now)
        # The key holds what tells two variants apart: argument types with their specialisations (an int equal
        # to 1 or a multiple of 16, a 16-byte aligned pointer) and the compile-time constants.
        name = getattr(info.get("fn"), "name", "?")
        self.events.append((began - self._start, now - began, f"{name}: {key}"[:1500]))
        return False
