"""Request intake: prompt validation, LoRA and per-request checks, the n / best_of
samples of a request and embedding (pooling) requests.  Every check runs before
anything is queued: a request either becomes a `RequestState` or raises ValueError."""

from __future__ import annotations

import time
from collections.abc import Container

import torch

from pagedserve.config import EngineConfig
from pagedserve.config_rules import check_logprobs_limit, check_prompt_fits_step
from pagedserve.engine.output_processor import RequestState, SequenceState
from pagedserve.engine.request_options import check_request_params, sample_params, truncate_prompt
from pagedserve.loader import IncrementalDetokenizer
from pagedserve.lora import LoRAManager, LoRARequest, lora_cache_salt
from pagedserve.multimodal.processor import MultiModalInputs, MultiModalProcessor
from pagedserve.multimodal.video import video_list
from pagedserve.pooling import PoolingParams, PoolingState
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.manager import StructuredOutputManager

__all__ = ["InputProcessor"]


class InputProcessor:
    """Turns what ``add_request`` is given into request state.

    ``in_use`` holds the ids of requests the engine tracks (a new id must not be one);
    ``prefix_caching``: samples of one request share the prompt's cached blocks."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        vocab_size: int,
        hidden_size: int,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        pooling: str,
        structured: StructuredOutputManager,
        lora: LoRAManager | None,
        prefix_caching: bool,
        in_use: Container[str],
        score_head: torch.Tensor | None = None,
        mm_processor: MultiModalProcessor | None = None,
    ) -> None:
        self.config = config
        #: A vision-language model's processor (images on), else None.
        self.mm_processor = mm_processor
        #: A sequence-classification checkpoint's float32 head [num_labels, hidden], or None.
        self.score_head = score_head
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.pooling = pooling
        self.structured = structured
        self.lora = lora
        self.prefix_caching = prefix_caching
        self.in_use = in_use

    def validate_prompt(
        self,
        prompt: str | list[int] | None,
        prompt_token_ids: list[int] | None,
        truncate_prompt_tokens: int | None = None,
    ) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt, keeping only its last ``truncate_prompt_tokens``
        tokens when set; ValueError naming the problem and the limit."""
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif isinstance(prompt, (list, tuple)):
                prompt_token_ids, prompt = list(prompt), None
            else:
                raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        kept = truncate_prompt(list(prompt_token_ids), truncate_prompt_tokens)
        if len(kept) < len(prompt_token_ids):
            prompt_token_ids = kept
            prompt = None if prompt is None else self.tokenizer.decode(kept, skip_special_tokens=False)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        check_prompt_fits_step(self.config.scheduler, len(prompt_token_ids))
        return prompt, list(prompt_token_ids)

    def check_lora_request(self, lora_request: LoRARequest | None) -> None:
        """Load ``lora_request``'s adapter into host memory (ValueError naming the file or
        field when it cannot serve this model); None is the base model."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.lora is None:
            raise ValueError(
                f"lora_request {lora_request.lora_name!r} needs an engine with enable_lora=True (--enable-lora)"
            )
        self.lora.add_adapter(lora_request)

    def _check_id(self, request_id: str) -> None:
        if request_id in self.in_use:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def process(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None,
        prompt_token_ids: list[int] | None,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
        lora_request: LoRARequest | None,
        multi_modal_data: dict | None = None,
    ) -> RequestState:
        """A generation request and its samples (``best_of`` or ``n`` of them);
        ``multi_modal_data``: ``{"image": PIL image or list of them}`` for a text prompt
        whose placeholders the model's processor expands."""
        if self.score_head is not None:
            raise ValueError(
                "this model is a sequence-classification checkpoint (no language-model head): it serves "
                "scoring, reranking, classification and embeddings, not generation"
            )
        params = params or SamplingParams()
        self.check_lora_request(lora_request)
        cache_salt = lora_cache_salt(cache_salt, lora_request)
        check_logprobs_limit(self.config.model, params)
        self._check_id(request_id)
        mm_items: list = []
        if multi_modal_data:
            prompt, prompt_token_ids, mm_items = self.expand_images(prompt, multi_modal_data, params)
        prompt, ids = self.validate_prompt(prompt, prompt_token_ids, params.truncate_prompt_tokens)
        if not mm_items and self.mm_processor is not None and self.mm_processor.image_token_id in ids:
            raise ValueError(
                f"the prompt holds the image token (id {self.mm_processor.image_token_id}) but no image was given "
                "(multi_modal_data / image_url content parts)"
            )
        video_id = self.mm_processor.video_token_id if self.mm_processor is not None else None
        if video_id is not None and video_id in ids and not any(m.modality == "video" for m in mm_items):
            raise ValueError(
                f"the prompt holds the video token (id {video_id}) but no video was given "
                "(multi_modal_data / video_url content parts)"
            )
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        check_request_params(params, self.vocab_size, encode)
        policy = self.config.scheduler.policy
        if priority != 0 and policy != "priority":
            raise ValueError(
                f"priority {priority} needs scheduling_policy='priority' (--scheduling-policy "
                f"priority); this engine schedules {policy!r}"
            )
        compiled = self.structured.prepare(params.structured_outputs) if params.structured_outputs else None
        arrival = time.monotonic() if arrival_time is None else arrival_time
        scores_prompt = {} if params.prompt_logprobs is not None else None
        group = RequestState(request_id, prompt, ids, [], arrival, params=params, prompt_logprobs=scores_prompt)
        first: Request | None = None
        children = sample_params(params, encode)
        for i, child_params in enumerate(children):
            rid = request_id if len(children) == 1 else f"{i}_{request_id}"
            # A request scoring its prompt computes every prompt position itself.
            share = self.prefix_caching and first is not None and first.sampling_params.prompt_logprobs is None
            req = Request(
                rid,
                ids,
                child_params,
                self.eos_token_ids,
                arrival,
                priority,
                cache_salt,
                self.max_model_len,
                wait_for=first if share else None,
                lora_request=lora_request,
                structured=self.structured.new_state(compiled) if compiled is not None else None,
                mm_items=mm_items,
            )
            first = first or req
            detok = IncrementalDetokenizer(self.tokenizer, ids, child_params.skip_special_tokens)
            group.seqs.append(SequenceState(req, i, detok, logprobs=[] if child_params.logprobs is not None else None))
        return group

    def expand_images(
        self, prompt: str | list[int] | None, data: dict | MultiModalInputs, params: SamplingParams
    ) -> tuple[str | None, list[int], list]:
        """(prompt, token ids with the image placeholders expanded, image items) of a
        prompt with ``multi_modal_data`` (or already processed: MultiModalInputs);
        ValueError naming what does not fit."""
        if isinstance(data, MultiModalInputs):
            if self.mm_processor is None:
                raise ValueError("this engine takes no images")
            if params.truncate_prompt_tokens is not None:
                raise ValueError("truncate_prompt_tokens cannot be combined with images")
            return prompt if isinstance(prompt, str) else None, list(data.prompt_token_ids), list(data.items)
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict like {{'image': image}}, got {type(data).__name__}")
        unknown = set(data) - {"image", "video"}
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modalities {sorted(unknown)} (supported: image, video)")
        images = data.get("image")
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        videos = video_list(data.get("video"))
        if self.mm_processor is None:
            raise ValueError(
                "this engine takes no images: the model is not a supported vision-language checkpoint, or images "
                "are off (limit_mm_per_prompt image=0)"
            )
        if not isinstance(prompt, str):
            raise ValueError(
                "a prompt with images must be text, so that the model's processor expands its placeholders"
            )
        if params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot be combined with images (it could cut an image's tokens)")
        ids, items = self.mm_processor.process(prompt, images, videos=videos)
        return prompt, ids, items

    def process_pooling(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        pooling: PoolingParams,
        prompt_token_ids: list[int] | None,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
    ) -> RequestState:
        """An embedding request: the prompt is computed, pooled, and the request finishes.
        ``task="classify"`` pools the last token and applies the score head."""
        classify = pooling.task == "classify"
        if classify and self.score_head is None:
            raise ValueError(
                "classification needs a sequence-classification checkpoint (a *ForSequenceClassification "
                "architecture with a score.weight head); this model has none"
            )
        if pooling.dimensions is not None and pooling.dimensions != self.hidden_size:
            raise ValueError(
                f"dimensions={pooling.dimensions} is not supported: this model's embeddings have "
                f"{self.hidden_size} dimensions (no truncation)"
            )
        self._check_id(request_id)
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority'")
        prompt, ids = self.validate_prompt(prompt, prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        params = SamplingParams(max_tokens=1)
        req = Request(
            request_id,
            ids,
            params,
            self.eos_token_ids,
            arrival,
            priority,
            cache_salt,
            self.max_model_len,
            pooling="last" if classify else self.pooling,
        )
        seq = SequenceState(req, 0, IncrementalDetokenizer(self.tokenizer, ids, True))
        state = PoolingState(req.pooling, head=self.score_head if classify else None)
        return RequestState(request_id, prompt, ids, [seq], arrival, params=params, pool=state, pooling_params=pooling)
