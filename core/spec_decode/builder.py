"""Building the engine's SpecDecoder from ``speculative_config``, and the start-up
checks that need the draft checkpoint's config (read before any weights load)."""

from __future__ import annotations

import torch

from pagedserve.config import EngineConfig
from pagedserve.config_rules import RECURRENT_STATE, check_parallel_fits_model
from pagedserve.executor.abstract import Executor
from pagedserve.executor.model_runner import ModelRunner, draft_kv_blocks
from pagedserve.loader import open_model
from pagedserve.models.layers import layer_windows
from pagedserve.models.llama import ArchConfig
from pagedserve.quantization.registry import quantize_source
from pagedserve.spec_config import SpeculativeConfig
from pagedserve.spec_decode.decoder import SpecDecoder
from pagedserve.spec_decode.draft_model import DraftModelProposer
from pagedserve.spec_decode.proposer import NgramProposer

__all__ = ["build_spec_decoder", "check_draft_model", "target_quantization", "DraftOnRanks"]


def target_quantization(config: EngineConfig) -> str | None:
    """The target's ``quantization``: self-speculation drafts with the quantized copy for
    the float weights, so an unset value means 'none' there."""
    spec = config.speculative.speculative_config
    q = config.model.quantization
    if spec is not None and spec.method == "self_quantized" and q in (None, "auto"):
        return "none"
    return q


def _draft_source(spec: SpeculativeConfig, config: EngineConfig):
    return open_model(spec.model if spec.method == "draft_model" else config.model.model)


def check_draft_model(config: EngineConfig, target: ArchConfig, max_model_len: int):
    """ValueError when the draft cannot draft for ``target``: another vocabulary,
    recurrent-state layers (Qwen3.5, Mamba hybrids), a shorter context, or (sharded
    with draft_tensor_parallel_size) heads the ranks cannot split.  Reads only the
    draft's config; returns its opened source (None for proposers without a model)."""
    spec = config.speculative.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    source = _draft_source(spec, config)
    arch = ArchConfig.from_hf(source.hf_config)
    if arch.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {spec.model!r} has a vocabulary of {arch.vocab_size} "
            f"tokens, the target {target.vocab_size}; a draft must share the target's vocabulary"
        )
    if RECURRENT_STATE in layer_windows(source.hf_config, arch.num_layers):
        raise ValueError(
            f"speculative_config: the draft model {spec.model!r} ({arch.architecture}) has recurrent-state "
            "layers, whose state drafting cannot rewind past the tokens the target rejects; use a draft "
            "without recurrent layers, or method 'ngram'"
        )
    if arch.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config: the draft model's context ({arch.max_position_embeddings} tokens) is "
            f"shorter than max_model_len={max_model_len}; lower max_model_len"
        )
    if spec.draft_tp > 1:
        try:
            check_parallel_fits_model(config, arch)
        except ValueError as exc:
            raise ValueError(
                f"speculative_config: the draft model {spec.model!r} with draft_tensor_parallel_size="
                f"{spec.draft_tp}: {exc}; use draft_tensor_parallel_size=1 (the draft whole on rank 0)"
            ) from None
    return source


class DraftOnRanks:
    """A draft model sharded over the target's ranks (draft_tensor_parallel_size), as
    :class:`DraftModelProposer` drives a runner: each draft forward runs on every rank
    through ``executor.forward_logits(..., draft=True)`` and returns rank 0's logits."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        shard = executor.draft_runner
        self.num_blocks, self.block_size = shard.num_blocks, shard.block_size
        self.ops = shard.model.head_ops  # where the logits are

    def forward_logits(self, out, block_ids: dict[str, list[int]], num_logits: list[int]) -> torch.Tensor:
        return self.executor.forward_logits(out, block_ids, num_logits, draft=True)


def build_spec_decoder(
    config: EngineConfig, executor: Executor, draft_source, max_model_len: int, dtype: torch.dtype
) -> SpecDecoder | None:
    """The SpecDecoder for ``config`` (None without speculative_config), verifying through
    ``executor``.  A draft model (or the target's quantized copy) loads whole in the
    engine's process, on rank 0's platform and in the target's dtype, beside the sampler,
    whether the target runs in this process or on tensor/pipeline parallel ranks, with a
    KV pool of :func:`draft_kv_blocks`; with draft_tensor_parallel_size it is sharded over
    the target's ranks instead (the executor loaded it)."""
    spec = config.speculative.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.draft_tp > 1:
        proposer = DraftModelProposer(DraftOnRanks(executor))
    else:
        runner = executor.driver_runner
        platform, ops = runner.platform, runner.ops
        arch = ArchConfig.from_hf(draft_source.hf_config)
        source = quantize_source(draft_source, spec.quantization, platform, ops, dtype)
        draft = ModelRunner(platform, ops, arch, dtype)
        draft.load_weights(source.weights())
        draft.allocate_kv_cache(draft_kv_blocks(runner, draft), runner.block_size)
        proposer = DraftModelProposer(draft)
    return SpecDecoder(spec, executor, proposer, max_model_len)
