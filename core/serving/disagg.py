"""Disaggregated prefill/decode: a prefill instance computes prompts' KV and hands the
blocks to a decode instance, which continues decoding.

Layout: the decode instance is an LLM in this process (rank 0); the prefill instance is
an LLMEngine in a spawned process (rank 1); the two talk over a torch.distributed pair
(gloo on CPU, the platform's backend otherwise).

Hand-off: the prefill engine runs each prompt with ``max_tokens=1`` (under the request's
LoRA adapter, whose KV differs from the base model's).  Its full blocks stay in its
prefix cache after the request finishes, so right after the step they are found by their
chained hashes (salted by the adapter as the engine salts them), gathered ([layers, 2,
blocks, block_size, kv_heads, head_size]) and sent.  The decode side writes them into
free blocks of its own cache and registers them in its prefix cache under the same
hashes; then it adds the request normally.  The scheduler sees a prefix-cache hit for every full block (the key is
compared, so a hash collision cannot inject wrong KV) and recomputes only the tail (less
than one block, plus the last prompt token whose logits it samples from).  Nothing in
the scheduler knows about disaggregation, and an evicted block is just recomputed.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pagedserve.config import EngineConfig
from pagedserve.config_rules import check_disaggregated, disaggregated_request_refusal
from pagedserve.distributed.parallel_state import free_port
from pagedserve.kv_cache.kv_groups import GroupedKVCacheManager
from pagedserve.loader import open_model
from pagedserve.lora import LoRARequest, lora_cache_salt
from pagedserve.lora.request import per_prompt_lora
from pagedserve.models.layers import engine_layer_count, layer_windows
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["DisaggregatedLLM"]

logger = logging.getLogger(__name__)


def _prefill_main(config: EngineConfig, addr: str, port: int, backend: str, timeout_s: float) -> None:
    """The prefill instance: receive a batch of prompts, stream back each one's KV."""
    from pagedserve.engine import LLMEngine

    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=1, world_size=2, timeout=timedelta(seconds=timeout_s)
    )
    try:
        if torch.accelerator.is_available() and torch.accelerator.device_count() > 1:
            torch.accelerator.set_device_index(1)  # the decode instance keeps device 0
        engine = LLMEngine(config)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        while True:
            box = [None]
            dist.recv_object_list(box, src=0)
            if box[0] is None:
                break
            prompts: dict[str, tuple[list[int], LoRARequest | None]] = {}
            for index, ids, lora in box[0]:
                engine.add_request(str(index), None, params, prompt_token_ids=ids, lora_request=lora)
                prompts[str(index)] = (ids, lora)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        ids, lora = prompts[out.request_id]
                        kv = engine.export_prefix_kv(ids, lora_cache_salt(None, lora))
                        # On the device: NCCL carries no CPU tensors.
                        dist.send(torch.tensor([int(out.request_id), kv.shape[2]], device=kv.device), dst=0)
                        if kv.shape[2]:
                            dist.send(kv, dst=0)
    finally:
        dist.destroy_process_group()


class DisaggregatedLLM:
    """``generate`` and ``beam_search`` like ``LLM``, with prompts prefilled by a separate
    instance.

    ``llm_kwargs`` configure both instances (same model, dtype and block size); the decode
    instance needs prefix caching (it is how blocks are handed over).  ``prefill_threads``
    / ``threads`` set each instance's CPU threads.
    """

    def __init__(
        self, model: str | None = None, prefill_threads: int | None = None, timeout_s: float = 300.0, **llm_kwargs
    ) -> None:
        from pagedserve.entrypoints.engine_args import engine_config_from_kwargs
        from pagedserve.entrypoints.llm import LLM

        config = engine_config_from_kwargs(model=model, **llm_kwargs)
        # Every refusal before weights load: the settings alone, then with the layers'
        # windows from the checkpoint's config.
        check_disaggregated(config)
        hf_config = open_model(config.model.model).hf_config
        check_disaggregated(config, layer_windows(hf_config, engine_layer_count(hf_config)))
        self.timeout_s = timeout_s
        self.llm = LLM.from_engine_config(config)
        engine = self.llm.llm_engine
        assert not isinstance(engine.kv, GroupedKVCacheManager)  # refused by check_disaggregated
        pconfig = replace(engine.config, device=replace(engine.config.device, threads=prefill_threads))
        addr, backend = "127.0.0.1", engine.platform.dist_backend
        port = free_port(addr)
        self.proc = mp.get_context("spawn").Process(
            target=_prefill_main, args=(pconfig, addr, port, backend, timeout_s), name="pagedserve-prefill", daemon=True
        )
        self.proc.start()
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=0, world_size=2, timeout=timedelta(seconds=timeout_s)
        )
        self._closed = False
        self.num_injected_blocks = 0
        self._batches = itertools.count()  # request ids d<batch>-<index>: unique in the decode engine

    def _receive(self, n: int, out: queue.Queue) -> None:
        engine = self.llm.llm_engine
        try:
            for _ in range(n):
                header = torch.empty(2, dtype=torch.int64, device=engine.platform.device)
                dist.recv(header, src=1)
                index, nb = header.tolist()
                kv = engine.empty_prefix_kv(nb)
                if nb:
                    dist.recv(kv, src=1)
                out.put((index, kv))
        except Exception as exc:  # handed to the caller's thread, which raises it
            out.put(exc)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Greedy-identical to one instance; decoding overlaps later prompts' prefill.
        ``lora_request`` and ``priority`` as ``LLM.generate`` takes them (one, or one per
        prompt): the prefill instance runs each prompt under its adapter, the decode
        instance's scheduler orders requests by priority."""
        if self._closed:
            raise RuntimeError("DisaggregatedLLM is shut down")
        engine = self.llm.llm_engine
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        loras = per_prompt_lora(lora_request, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(params) != len(prompts) or len(priorities) != len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts, {len(params)} sampling_params and {len(priorities)} priorities"
            )
        for lora in loras:
            engine.check_lora_request(lora)  # before the prefill instance sees it
        normalized = [engine.validate_prompt(*self.llm.split_prompt(p)) for p in prompts]
        base = next(self._batches)
        ids = [f"d{base}-{i}" for i in range(len(prompts))]
        dist.send_object_list([[(i, toks, loras[i]) for i, (_, toks) in enumerate(normalized)]], dst=1)
        arrivals: queue.Queue = queue.Queue()
        receiver = threading.Thread(target=self._receive, args=(len(prompts), arrivals), daemon=True)
        receiver.start()
        final: dict[str, RequestOutput] = {}
        added = 0
        while len(final) < len(prompts):
            block = added < len(prompts) and not engine.has_unfinished_requests()
            while added < len(prompts):
                try:
                    item = arrivals.get(timeout=1.0) if block else arrivals.get_nowait()
                except queue.Empty:
                    if block and not self.proc.is_alive():
                        raise RuntimeError(
                            f"prefill instance (pid {self.proc.pid}) exited with code {self.proc.exitcode}"
                        ) from None
                    break
                if isinstance(item, Exception):
                    raise RuntimeError(f"prefill instance failed: {item}") from item
                block = False
                index, kv = item
                text, toks = normalized[index]
                lora = loras[index]
                self.num_injected_blocks += engine.import_prefix_kv(toks, kv, lora_cache_salt(None, lora))
                engine.add_request(
                    ids[index],
                    text,
                    params[index],
                    prompt_token_ids=toks,
                    priority=priorities[index],
                    lora_request=lora,
                )
                added += 1
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        receiver.join(timeout=self.timeout_s)
        return [final[i] for i in ids]

    def embed(self, prompts, pooling_params=None, use_tqdm: bool = False):
        """Refused (ValueError): an embedding has no decode phase to disaggregate."""
        raise ValueError(disaggregated_request_refusal("pooling"))

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """``LLM.beam_search`` over this pair: each step's beams are prompts that the
        prefill instance computes and hands over, the decode instance samples one token."""
        engine = self.llm.llm_engine
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        ids = [engine.validate_prompt(*self.llm.split_prompt(p))[1] for p in prompts]
        search = BeamSearch(ids, params, engine.eos_token_ids, engine.max_model_len)

        def expand(tokens: list[list[int]], step: SamplingParams) -> list:
            outs = self.generate([{"prompt_token_ids": t} for t in tokens], step)
            return [o.outputs[0].logprobs[0] for o in outs]

        search.run(expand)
        return search.outputs(lambda t: engine.tokenizer.decode(t))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive():
            try:
                dist.send_object_list([None], dst=1)
            except RuntimeError as exc:  # the prefill side is already gone; it is ended below
                logger.warning("could not tell the prefill instance to stop: %s", exc)
            self.proc.join(timeout=15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        dist.destroy_process_group()
        self.llm.shutdown()
