"""End to end: the engine's greedy outputs on the platform equal the CPU reference's.

The engine runs twice on the same tiny random Llama checkpoint, in float32: once on
the platform under test (``PAGEDSERVE_TARGET_DEVICE=NAME``), once on the builtin ``cpu``
platform with its native kernels off (``PAGEDSERVE_CPU_KERNELS=0``: every op is the
torch reference) and only builtin plugins loaded.  The batch mixes prompt lengths under
a small token budget, so it has chunked prefills next to decodes, and a second round
re-sends the prompts so that shared prefixes come from the prefix cache.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.testing.checks import CheckSkipped
from pagedserve.testing.target import Target
from pagedserve.testing.tiny_model import make_tiny_llama

__all__ = ["engine_greedy_check", "greedy_token_ids", "GreedyRun", "ENGINE_SETTINGS", "conformance_prompts"]

#: Engine arguments: a 32-token budget splits the 40-token prompt into chunks that share
#: steps with decodes; 16-token blocks put block boundaries inside every long prompt.
ENGINE_SETTINGS = dict(
    dtype="float32",
    block_size=16,
    max_num_batched_tokens=32,
    max_num_seqs=8,
    max_model_len=256,
    kv_cache_memory="8MiB",
    enable_prefix_caching=True,
    seed=0,
)

MAX_NEW_TOKENS = (12, 16, 8, 12, 10, 14)


def conformance_prompts(vocab_size: int = 259, seed: int = 0) -> list[list[int]]:
    """Token-id prompts: lengths 1, 5, 17 and 40, and two that share a 20-token prefix."""
    rng = random.Random(seed)
    tok = lambda: rng.randrange(3, vocab_size)  # noqa: E731 -- ids 0-2 are special tokens
    shared = [tok() for _ in range(20)]
    prompts = [[tok() for _ in range(n)] for n in (1, 5, 17, 40)]
    return prompts + [shared + [tok() for _ in range(n)] for n in (3, 9)]


@contextlib.contextmanager
def _environ(changes: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the duration of the block."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        for k, v in changes.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class GreedyRun:
    """What one engine produced, and what it ran on."""

    platform: str
    overridden_ops: dict[str, str]
    rounds: list[list[list[int]]]  # [round][prompt] -> generated token ids
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache


def greedy_token_ids(model: str | Path, env: dict[str, str | None]) -> GreedyRun:
    """Greedy token ids of two rounds (the prompts, then the same prompts in reverse
    order, put back in prompt order) from an engine whose platform ``env`` chooses."""
    from pagedserve import LLM, SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_NEW_TOKENS]
    with _environ(env):
        llm = LLM(model=str(model), **ENGINE_SETTINGS)
        try:
            engine = llm.llm_engine
            prompts = conformance_prompts(engine.arch.vocab_size)
            first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            second = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params[::-1], use_tqdm=False)]
            overridden = {n: src for n, src in engine.ops.table() if src != "reference"}
            run = GreedyRun(
                engine.platform.name,
                overridden,
                [[list(t) for t in first], [list(t) for t in second[::-1]]],
                engine.kv.prefix_hits,
            )
        finally:
            del llm
            gc.collect()
    return run


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def engine_greedy_check(target: Target, model: str | Path | None = None) -> str:
    """Compare greedy outputs on ``target`` with the CPU reference; AssertionError on a difference.

    model: a Llama-family checkpoint folder; None makes a tiny random one (in float32).
    """
    if not target.discovered:
        raise CheckSkipped(
            "the platform was registered in-process, but the engine selects platforms "
            "through entry-point discovery: install the plugin to run this check"
        )
    if torch.float32 not in tuple(target.platform.supported_dtypes):
        raise CheckSkipped("greedy outputs are compared in float32, which the platform does not support")
    with tempfile.TemporaryDirectory(prefix="pagedserve-conformance-") as tmp:
        path = Path(model) if model is not None else make_tiny_llama(Path(tmp) / "tiny-llama")
        got = greedy_token_ids(path, {"PAGEDSERVE_TARGET_DEVICE": target.name})
        want = greedy_token_ids(
            path, {"PAGEDSERVE_TARGET_DEVICE": "cpu", "PAGEDSERVE_CPU_KERNELS": "0", "PAGEDSERVE_PLUGINS": "pagedserve"}
        )
    # Guard the comparison itself: each engine must have run where it was meant to.
    assert got.platform == target.name, f"the engine selected {got.platform!r}, not {target.name!r}"
    assert got.overridden_ops == target.overridden_ops(), (
        f"the engine on {target.name!r} resolved other ops ({got.overridden_ops}) than the kit "
        f"({target.overridden_ops()})"
    )
    assert want.platform == "cpu" and not want.overridden_ops, (
        f"the reference engine ran on {want.platform!r} with overridden ops {want.overridden_ops}"
    )
    for rnd, (g_round, w_round) in enumerate(zip(got.rounds, want.rounds), start=1):
        for i, (g, w) in enumerate(zip(g_round, w_round)):
            if g != w:
                at = _first_difference(g, w)
                what = "first round" if rnd == 1 else "second round (prefixes from the prefix cache)"
                raise AssertionError(
                    f"engine on {target.name!r}: greedy tokens of prompt {i} ({what}) differ from the cpu "
                    f"reference at generated token {at}: {g} vs {w}"
                )
    n = sum(len(g) for r in got.rounds for g in r)
    return (
        f"{len(got.rounds[0])} prompts x 2 rounds, {n} greedy tokens identical to the cpu reference "
        f"({got.prefix_hit_tokens} prompt tokens from the prefix cache)"
    )
