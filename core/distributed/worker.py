"""Worker: one rank's model shard and KV cache shard, driven by rank 0 one step at a time.

Every step the driver (rank 0) turns the SchedulerOutput into CPU model inputs split in
micro-batches, plans each one's tail (pagedserve.executor.sample_step: the rows to read,
the grammar bitmask), broadcasts the inputs with the rows once, and all ranks run them.
With pipeline parallelism a stage receives (hidden, residual) of a micro-batch from the
previous stage, runs its layers and sends them on without waiting, so while the last
stage works on micro-batch 0 the first already computes micro-batch 1.  The last stage
runs the tail's head (logits all-gathered across its tensor-parallel ranks, prompt
logprobs, pooling) and hands its output to rank 0, the only rank that samples: rank 0
finishes the tail exactly as a single-process runner does.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pagedserve.config import EngineConfig
from pagedserve.distributed.parallel_state import DistInit, ParallelContext, destroy_distributed, init_distributed
from pagedserve.executor.attention_metadata import AttentionMetadata
from pagedserve.executor.input_batch import prepare_inputs
from pagedserve.executor.model_runner import ModelRunner, draft_kv_blocks, resolve_dtype
from pagedserve.executor.prompt_logprobs import PromptRows
from pagedserve.executor.sample_step import HeadOutput, StepOutput, TailRows, finish_step, plan_step, run_head
from pagedserve.lora import LoRAManager
from pagedserve.models.arch_config import ArchConfig
from pagedserve.offload.connectors import create_tier_connector
from pagedserve.scheduler import SchedulerOutput

__all__ = ["Worker", "MicroBatch", "Keepalive", "split_micro_batches", "run_worker_process", "default_threads"]

#: The empty command rank 0 sends while no step runs (Keepalive).
KEEPALIVE = "keepalive"


@dataclass
class MicroBatch:
    """CPU model inputs of a slice of the step's requests.

    input_ids int64 [n]; meta as in AttentionMetadata; tail: the final hidden rows its
    tail reads (sampling, prompt logprobs, pooling); lora: with enable_lora, its
    adapters' slot writes and row -> slot map (pagedserve.lora.LoRAStep, decided by
    rank 0), or None.
    """

    input_ids: torch.Tensor
    meta: AttentionMetadata
    tail: TailRows
    lora: Any = None
    #: Run the sharded draft model (speculative decoding) instead of the target.
    draft: bool = False
    #: The step's device-layout KV connector copies (the host tier's KVTransfers), on its
    #: first micro-batch only: every rank runs them between its own share of the KV cache
    #: and its own store before the step's forward.
    kv_transfers: Any = None


def split_micro_batches(out: SchedulerOutput, n: int) -> list[list[int]]:
    """Indices of ``out.scheduled`` in up to ``n`` contiguous groups of similar token counts."""
    total = sum(s.num_new_tokens for s in out.scheduled)
    groups: list[list[int]] = [[]]
    acc = 0
    for i, s in enumerate(out.scheduled):
        if groups[-1] and len(groups) < n and acc >= total * len(groups) / n:
            groups.append([])
        groups[-1].append(i)
        acc += s.num_new_tokens
    return groups


def _meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return meta.apply(lambda t: t.to(device))


class Keepalive:
    """Rank 0's turns at the broadcast, and an empty command while none comes.

    Ranks > 0 wait for the next step inside the broadcast, a collective bounded by
    ``distributed_timeout_s`` like every other: an engine left idle for longer would have
    them time out and exit, and its next request fail.  While no step runs, a thread of
    rank 0 sends them the ``keepalive`` command every quarter of that timeout.  Every
    driver operation (a step's broadcast and the collectives of its forward, a command,
    the stop) runs as one ``turn``, so that the thread's command never falls between a
    step's collectives.  A failed command (a worker gone) ends the thread; the engine's
    next step then meets the failure and names it.
    """

    def __init__(self, broadcast, timeout_s: float) -> None:
        self._broadcast = broadcast
        self.interval = max(0.05, timeout_s / 4)
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self.sent = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pagedserve-keepalive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval / 2):
            with self._lock:
                if self._stopped.is_set():
                    return
                if time.monotonic() - self._last < self.interval:
                    continue
                try:
                    self._broadcast((KEEPALIVE,))
                except Exception as exc:  # noqa: BLE001 - a worker gone: the next step reports it
                    self.error = exc
                    return
                self.sent += 1
                self._last = time.monotonic()

    @contextmanager
    def turn(self):
        """Hold the broadcast for one driver operation."""
        with self._lock:
            try:
                yield
            finally:
                self._last = time.monotonic()

    def stop(self) -> None:
        """No more commands (before the workers are told to leave, or the group goes)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            with self._lock:
                pass


class Worker:
    """Builds this rank's runner (weights shard, KV shard) and runs broadcast steps."""

    def __init__(self, config: EngineConfig, rank: int, init: DistInit, local_rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        # Which of this machine's visible accelerators the rank uses (Ray narrows the
        # visible set to one device per actor, so 0 there).
        self.local_rank = local_rank
        self.init = init
        self.runner: ModelRunner | None = None
        #: The draft model's shard (speculative_config draft_tensor_parallel_size > 1).
        self.draft: ModelRunner | None = None
        self.parallel: ParallelContext | None = None
        #: This rank's checkpoint (the engine's source on rank 0), set by setup.
        self.source = None
        self.num_micro_batches = 2 if init.pp_size > 1 else 1
        #: Rank 0 of a group of several: the driver's turns and the idle commands.
        self.keepalive: Keepalive | None = None

    def setup(self, source=None, on_ready=None) -> int:
        """Join the group, load this rank's shard, agree on the KV block count (the minimum
        over ranks) and allocate it.  Collective: every rank calls it.  Returns the count.
        ``on_ready`` is called just before joining the group (start-up watch)."""
        from pagedserve.loader.validation import effective_max_model_len
        from pagedserve.platforms import select_platform

        cfg = self.config
        platform, ops = select_platform(cfg.device.device)
        accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accel is not None and accel.type == platform.device_type:
            # Tensors on the bare device type (and NCCL) then land on this rank's device.
            torch.accelerator.set_device_index(self.local_rank)
        if on_ready is not None:
            on_ready()
        self.parallel = init_distributed(self.init, self.rank, platform.device)
        dtype = resolve_dtype(cfg.model.dtype, platform)
        if source is None:  # ranks other than the engine's load the checkpoint themselves
            source = self._open_target(platform, ops, dtype)
        self.source = source  # read again on waking from sleep level 2
        arch = ArchConfig.from_hf(source.hf_config)
        cfg = self.config = self._agree_on_block_size(cfg, platform, arch)
        max_model_len = effective_max_model_len(cfg.model.max_model_len, arch.max_position_embeddings, arch.head_dim)
        self.runner = ModelRunner(
            platform,
            ops,
            arch,
            dtype,
            self.parallel,
            max_model_len=max_model_len,
            residual_dtype=cfg.model.residual_dtype,
        )
        self.runner.load_weights(source.weights())
        local = self.runner.determine_num_blocks(cfg.cache, cfg.scheduler, max_model_len, self.parallel.min_over_ranks)
        num_blocks = self.parallel.min_over_ranks(local)
        self.runner.allocate_kv_cache(num_blocks, cfg.cache.block_size)
        tier = create_tier_connector(cfg.cache)
        if tier is not None:
            # The device-layout KV connector (the host tier of kv_offload_memory, or a
            # plugin's): this rank's own store, its bytes per rank like the device budget;
            # one block index means one block on every rank, so every rank holds the
            # smallest rank's count.  Rank 0 plans the copies, every rank runs them.
            per_block = self.runner.kv_block_bytes(cfg.cache.block_size)
            num_host = self.parallel.min_over_ranks(tier.num_blocks(per_block))
            if num_host >= 1:  # else the engine's build_kv_manager says why it holds no block
                self.runner.use_kv_connector(tier)
                self.runner.allocate_host_kv_cache(num_host)
        LoRAManager.attach(cfg.lora, self.runner)  # enable_lora: this rank's adapter shards
        spec = cfg.speculative.speculative_config
        if spec is not None and spec.draft_tp > 1:
            self.draft = self._load_draft(spec, platform, ops, dtype)
        if self.rank == 0 and self.parallel.world_size > 1:
            self.keepalive = Keepalive(self.parallel.broadcast_object, self.init.timeout_s)
        return num_blocks

    @contextmanager
    def _turn(self):
        """Rank 0: one driver operation, the idle commands held off (Keepalive)."""
        if self.keepalive is None:
            yield
        else:
            with self.keepalive.turn():
                yield

    def _agree_on_block_size(self, cfg: EngineConfig, platform, arch: ArchConfig) -> EngineConfig:
        """``cfg`` with the KV block size every rank uses.  The engine's own ranks get it
        resolved; a worker node's ranks (``--headless``) resolve their node's settings as
        the engine does; ValueError on every rank when two ranks differ (different
        platforms' defaults), since their block tables would not match."""
        from pagedserve.config_rules import resolve_block_size
        from pagedserve.models.layers import layer_windows

        if cfg.cache.block_size is None:
            windows = layer_windows(arch.hf_config, arch.num_layers)
            cfg = resolve_block_size(cfg, [platform.default_block_size], windows)[0]
        bs = cfg.cache.block_size
        low, high = self.parallel.min_over_ranks(bs), -self.parallel.min_over_ranks(-bs)
        if low != high:
            raise ValueError(
                f"the ranks' KV block sizes differ ({low} to {high} tokens; rank {self.rank}: {bs}), as their "
                "platforms' defaults do: set block_size (--block-size) on every node"
            )
        return cfg

    def _open_target(self, platform, ops, dtype: torch.dtype):
        """The target checkpoint, its linear weights loading quantized as in the engine's
        process (each rank then keeps its shard of them in their quantized form)."""
        from pagedserve.loader import open_model
        from pagedserve.quantization.registry import quantize_source

        cfg = self.config
        q, spec = cfg.model.quantization, cfg.speculative.speculative_config
        if spec is not None and spec.method == "self_quantized" and q in (None, "auto"):
            q = "none"  # as spec_decode.builder.target_quantization: that draft needs float weights
        return quantize_source(open_model(cfg.model.model), q, platform, ops, dtype, self.init.world_size)

    def _load_draft(self, spec, platform, ops, dtype: torch.dtype) -> ModelRunner:
        """This rank's shard of the draft model and of its KV cache (as many blocks on
        every rank, within the bytes of the target's KV shard)."""
        from pagedserve.loader import open_model
        from pagedserve.quantization.registry import quantize_source

        source = open_model(spec.model)
        source = quantize_source(source, spec.quantization, platform, ops, dtype, self.init.world_size)
        draft = ModelRunner(platform, ops, ArchConfig.from_hf(source.hf_config), dtype, self.parallel)
        draft.load_weights(source.weights())
        num_blocks = self.parallel.min_over_ranks(draft_kv_blocks(self.runner, draft))
        draft.allocate_kv_cache(num_blocks, self.runner.block_size)
        return draft

    # -- driver side ------------------------------------------------------------------------
    def execute_driver(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepOutput:
        """Rank 0: broadcast the step, run its share, sample once."""
        runner = self.runner
        lora = runner.lora_manager
        # The step's adapters keep their slots through all of its micro-batches.
        loras = [s.request.lora_request for s in out.scheduled] if lora is not None else []
        pinned = {x.lora_int_id for x in loras if x is not None}
        batches, plans = [], []
        for group in split_micro_batches(out, self.num_micro_batches):
            sub = SchedulerOutput(scheduled=[out.scheduled[i] for i in group])
            inp = prepare_inputs(
                sub, block_ids, runner.block_size, torch.device("cpu"), runner.layer_groups, runner.state_groups
            )
            plan = plan_step(sub.scheduled, inp.logits_indices, runner.arch.vocab_size)
            rows = [(s.request.lora_request, s.num_new_tokens) for s in sub.scheduled]
            lora_step = lora.plan(rows, pinned) if lora is not None else None
            batches.append(MicroBatch(inp.input_ids, inp.meta, plan.rows, lora_step))
            plans.append(plan)
        batches[0].kv_transfers = getattr(out, "kv_transfers", None) or None
        with self._turn():
            self.parallel.broadcast_object(batches)
            heads = self.run_step(batches)
        result = StepOutput({}, {})
        with torch.inference_mode():
            for plan, head in zip(plans, heads):
                result.update(finish_step(runner.sampler, runner.model.head_ops, plan, head))
        return result

    def forward_logits_driver(
        self, out: SchedulerOutput, block_ids: dict[str, list[int]], num_logits: list[int], draft: bool = False
    ) -> torch.Tensor:
        """Rank 0: broadcast a step whose tail reads the last ``num_logits[i]`` rows of
        each scheduled request (speculative decoding verifies drafts with them) and
        return their logits ``[sum(num_logits), vocab]``.  The other ranks run it as any
        step: the rows are the micro-batches' TailRows.  ``draft``: the sharded draft
        model's forward (its own block ids and KV cache)."""
        if draft and getattr(out, "kv_transfers", None):
            raise RuntimeError("the draft model's KV cache has no host tier")
        runner, batches = self.draft if draft else self.runner, []
        # The target's verification rows carry their requests' adapters, as execute_driver's do.
        lora = runner.lora_manager  # None for the draft
        loras = [s.request.lora_request for s in out.scheduled] if lora is not None else []
        pinned = {x.lora_int_id for x in loras if x is not None}
        for group in split_micro_batches(out, self.num_micro_batches):
            sub = SchedulerOutput(scheduled=[out.scheduled[i] for i in group])
            inp = prepare_inputs(
                sub, block_ids, runner.block_size, torch.device("cpu"), runner.layer_groups, runner.state_groups
            )
            ends = np.cumsum([s.num_new_tokens for s in sub.scheduled]).tolist()
            rows = [np.arange(e - num_logits[i], e) for e, i in zip(ends, group) if num_logits[i]]
            idx = torch.from_numpy(np.concatenate(rows)) if rows else torch.empty(0, dtype=torch.int64)
            lora_step = (
                lora.plan([(s.request.lora_request, s.num_new_tokens) for s in sub.scheduled], pinned)
                if lora is not None
                else None
            )
            tail = TailRows(idx, len(idx), PromptRows(), [])
            batches.append(MicroBatch(inp.input_ids, inp.meta, tail, lora_step, draft=draft))
        batches[0].kv_transfers = getattr(out, "kv_transfers", None) or None
        with self._turn():
            self.parallel.broadcast_object(batches)
            logits = [h.logits for h in self.run_step(batches) if h.logits is not None]
        if len(logits) == 1:
            return logits[0]
        return torch.cat(logits) if logits else torch.empty(0, runner.arch.vocab_size, device=runner.device)

    def control_driver(self, command: str, *args) -> None:
        """Rank 0: have every rank run ``command`` (sleep mode: "sleep" with its level,
        "wake_up"), the others through their loop, in step order."""
        with self._turn():
            self.parallel.broadcast_object((command, *args))
            self.control(command, *args)

    def control(self, command: str, *args) -> None:
        """Sleep mode on this rank: drop the shard's weights and KV cache, or rebuild them;
        ``keepalive``: nothing (rank 0's command while no step runs)."""
        if command == KEEPALIVE:
            return
        if command == "sleep":
            (level,) = args
            self.runner.sleep(level, self.source.weights() if level == 1 else None)
        elif command == "wake_up":
            self.runner.wake_up(self.source.weights)
        else:
            raise ValueError(f"unknown worker command {command!r}")

    def stop_workers(self) -> None:
        """Rank 0: tell the other ranks to leave their loop."""
        if self.keepalive is not None:
            self.keepalive.stop()
        self.parallel.broadcast_object(None)

    # -- every rank -------------------------------------------------------------------------
    def run_loop(self) -> None:
        """Ranks > 0: run broadcast steps until the driver sends None."""
        while (batches := self.parallel.broadcast_object()) is not None:
            if isinstance(batches, tuple):  # a command (control_driver), not a step
                self.control(*batches)
            else:
                self.run_step(batches)

    def run_step(self, batches: list[MicroBatch]) -> list[HeadOutput]:
        """Forward every micro-batch through this rank's layers; rank 0 gets each one's
        head output (sample_step.run_head: computed by the last stage, sent by its first
        tensor-parallel rank when that is not rank 0)."""
        runner = self.draft if batches and batches[0].draft else self.runner
        p, model = self.parallel, runner.model
        dev, hidden = runner.device, runner.arch.hidden_size
        heads: list[HeadOutput] = []
        pending = []  # isend handles; their tensors stay referenced until waited on
        with torch.inference_mode():
            if batches and batches[0].kv_transfers:  # spills, reloads, swaps: before the forward
                runner.run_kv_transfers(batches[0].kv_transfers)
            for mb in batches:
                if runner.lora_manager is not None:  # every rank fills the same slots in the same order
                    runner.lora_manager.apply(mb.lora)
                ids = mb.input_ids.to(dev)
                meta = _meta_to(mb.meta, dev)
                if p.is_first_stage:
                    x, residual = model.embed_tokens(ids), None
                else:
                    # A float32 residual stream crosses stages in float32, x with it.
                    x = torch.empty(ids.shape[0], hidden, dtype=model.residual_dtype, device=dev)
                    residual = torch.empty_like(x)
                    prev = p.stage_peer(p.pp_rank - 1)
                    dist.recv(x, src=prev)
                    dist.recv(residual, src=prev)
                x, residual = model.forward_layers(x, residual, meta, runner.kv_caches)
                if not p.is_last_stage:
                    nxt = p.stage_peer(p.pp_rank + 1)
                    x, residual = x.to(model.residual_dtype).contiguous(), residual.contiguous()
                    pending += [(dist.isend(x, dst=nxt), x), (dist.isend(residual, dst=nxt), residual)]
                    continue
                head = run_head(model, model.final_norm(x, residual), mb.tail, lambda t: t.to(dev))
                if p.rank == 0:
                    heads.append(head)
                elif p.tp_rank == 0 and p.pp_size > 1:
                    pending += [(dist.isend(t, dst=0), t) for t in head.widened().tensors()]
            if p.rank == 0 and p.pp_size > 1:
                src = (p.pp_size - 1) * p.tp_size  # the last stage's first tensor-parallel rank
                for mb in batches:
                    head = HeadOutput.empty(mb.tail, runner.arch.vocab_size, hidden, dev)
                    for t in head.tensors():
                        dist.recv(t, src=src)
                    heads.append(head)
            for work, _ in pending:
                work.wait()
            if runner.lora_manager is not None:
                runner.lora_manager.end_step()
        return heads

    def close(self) -> None:
        if self.keepalive is not None:
            self.keepalive.stop()
        destroy_distributed()


def run_worker_process(
    config: EngineConfig, rank: int, init: DistInit, threads: int | None, local_rank: int | None = None, status=None
) -> None:
    """Entry point of a worker process (rank > 0): set up, serve steps, leave cleanly.

    ``status``: the write end of a start-up pipe (see pagedserve.distributed.lifecycle).
    """
    from pagedserve.distributed.lifecycle import StartupReporter

    report = StartupReporter(status)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(config.model.seed)
    worker = Worker(config, rank, init, rank if local_rank is None else local_rank)
    try:
        try:
            worker.setup(on_ready=report.ready)
        except BaseException as exc:
            report.failed(exc)
            raise
        worker.run_loop()
    finally:
        worker.close()


def default_threads(config: EngineConfig, world_size: int) -> int:
    """CPU threads per rank: the configured count, else the cores split between ranks."""
    return config.device.threads or max(1, (os.cpu_count() or 1) // world_size)
