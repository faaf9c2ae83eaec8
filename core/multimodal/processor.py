"""MultiModalProcessor: the checkpoint's own transformers processor (its image
processor, with PIL, and its tokenizer) turns a prompt with image placeholders and the
images into token ids -- each placeholder expanded into as many image tokens as the
vision model produces for that image -- and the vision model's inputs."""

from __future__ import annotations

import pathlib
import threading
from dataclasses import dataclass, field
from typing import Any

from pagedserve.config import EngineConfig, images_per_prompt, videos_per_prompt
from pagedserve.multimodal.limits import MediaLimits
from pagedserve.multimodal.media import MultiModalItem, check_image, image_hash
from pagedserve.multimodal.video import check_video

__all__ = [
    "MultiModalInputs",
    "MultiModalProcessor",
    "image_token_runs",
    "build_mm_processor",
    "media_limits",
]


@dataclass
class MultiModalInputs:
    """A prompt already through the processor (e.g. on a server's worker thread, so the
    engine's thread does not run it): its expanded token ids and its images' items.
    ``add_request(..., multi_modal_data=MultiModalInputs(...))`` takes it as it is."""

    prompt_token_ids: list[int]
    items: list[MultiModalItem] = field(default_factory=list)


def media_limits(config: EngineConfig) -> MediaLimits:
    """The engine's limits on one request's images."""
    m = config.model
    return MediaLimits(
        max_images=images_per_prompt(m),
        allowed_local_media_path=m.allowed_local_media_path,
        max_videos=videos_per_prompt(m),
    )


def build_mm_processor(config: EngineConfig, folder: pathlib.Path, runner) -> MultiModalProcessor | None:
    """The processor of a vision-language model whose vision side ``runner`` loaded
    (images on); None otherwise."""
    vision = getattr(runner, "vision", None)
    if vision is None:
        return None
    return MultiModalProcessor(
        folder,
        vision.image_token_id,
        media_limits(config),
        load=getattr(vision, "load_processor", None),
        video=getattr(vision, "expand_video", None),
        video_token_id=getattr(vision, "video_token_id", None),
        items=getattr(vision, "mm_items", None),
    )


def image_token_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of ``token_id`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] == token_id:
            j = i
            while j < n and ids[j] == token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


class MultiModalProcessor:
    """Prompt + images -> (token ids, one :class:`MultiModalItem` per image).

    folder: the checkpoint (processor_config.json / preprocessor_config.json beside the
    tokenizer); image_token_id: the placeholder token the processor expands;
    placeholder: its text (what a chat template writes for an image part).
    """

    def __init__(
        self,
        folder: pathlib.Path,
        image_token_id: int,
        limits: MediaLimits,
        load=None,
        video=None,
        video_token_id: int | None = None,
        items=None,
    ) -> None:
        self.folder = folder
        #: How the model's processor is built from the folder (default: AutoProcessor).
        self._load = load
        #: The vision side's ``expand_video(processor, video)``: (the text that replaces
        #: the video's placeholder, one data dict per run of ``video_token_id`` in it);
        #: None when the model takes no videos.
        self._video = video
        self.video_token_id = video_token_id
        #: How the model's items come from the processor's output: (processor, ids, image
        #: token runs, number of images, output tensors, image hashes) -> (offset, length,
        #: hash, data) per item (several per image: SmolVLM's tiles); default: one per image.
        self._items = items
        self.image_token_id = image_token_id
        self.limits = limits
        self._processor: Any = None
        self._lock = threading.Lock()
        #: One call at a time: a fast tokenizer is not safe to call from several threads.
        self._call_lock = threading.Lock()

    @property
    def processor(self):
        """The transformers processor, loaded on first use (ValueError when the
        checkpoint has none)."""
        with self._lock:
            if self._processor is None:
                from transformers import AutoProcessor

                try:
                    load = self._load or AutoProcessor.from_pretrained
                    self._processor = load(str(self.folder))
                except Exception as e:  # noqa: BLE001 - transformers raises many kinds; name the folder
                    raise ValueError(
                        f"the checkpoint {str(self.folder)!r} has no usable image processor "
                        f"(processor_config.json / preprocessor_config.json): {e}"
                    ) from e
                if not hasattr(self._processor, "image_processor"):
                    raise ValueError(f"the checkpoint {str(self.folder)!r} has no image processor")
            return self._processor

    @property
    def placeholder(self) -> str:
        """The image placeholder text a prompt holds once per image (the processor's
        ``image_token``, e.g. ``<image>``)."""
        proc = self.processor
        token = getattr(proc, "image_token", None) or getattr(proc, "boi_token", None)
        if not isinstance(token, str):
            raise ValueError(f"the processor of {str(self.folder)!r} names no image placeholder token")
        return token

    @property
    def video_placeholder(self) -> str | None:
        """The video placeholder text (the processor's ``video_token``), or None when the
        model takes no videos."""
        token = getattr(self.processor, "video_token", None) if self._video is not None else None
        return token if isinstance(token, str) else None

    def _expand_videos(self, prompt: str, videos: list) -> tuple[str, list, list[list[dict]]]:
        """(the prompt with each video placeholder replaced by the video's text, the
        checked videos, each video's data dicts: one per run of video tokens)."""
        if self._video is None or self.video_token_id is None:
            raise ValueError("this model takes no videos")
        if len(videos) > self.limits.max_videos:
            raise ValueError(
                f"the prompt has {len(videos)} videos; at most {self.limits.max_videos} are accepted "
                "(--limit-mm-per-prompt video=N)"
            )
        videos = [check_video(v, self.limits) for v in videos]
        token = self.video_placeholder
        pieces = prompt.split(token)
        if len(pieces) - 1 != len(videos):
            raise ValueError(
                f"the prompt has {len(pieces) - 1} video placeholder(s) ({token}) for {len(videos)} video(s)"
            )
        text, parts = pieces[0], []
        for video, rest in zip(videos, pieces[1:]):
            replacement, data = self._video(self.processor, video)
            text += replacement + rest
            parts.append(data)
        return text, videos, parts

    def process(
        self, prompt: str, images: list, add_special_tokens: bool = True, videos: list | None = None
    ) -> tuple[list[int], list[MultiModalItem]]:
        """Token ids of ``prompt`` with its image (and video) placeholders expanded, and
        the items of its images and videos in prompt order.  ValueError when the
        placeholders and images or videos disagree."""
        if len(images) > self.limits.max_images:
            raise ValueError(
                f"the prompt has {len(images)} images; at most {self.limits.max_images} are accepted "
                "(--limit-mm-per-prompt)"
            )
        images = [check_image(im, self.limits) for im in images]
        proc = self.processor
        video_parts: list[list[dict]] = []
        if videos:
            with self._call_lock:
                prompt, videos, video_parts = self._expand_videos(prompt, list(videos))
        try:
            with self._call_lock:
                out = proc(
                    text=[prompt], images=images or None, return_tensors="pt", add_special_tokens=add_special_tokens
                )
        except ValueError as e:
            raise ValueError(f"the prompt and its {len(images)} image(s) do not match: {e}") from None
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        runs = image_token_runs(ids, self.image_token_id)
        if self._items is not None:
            tensors = {k: v for k, v in out.items() if k not in _NOT_IMAGE_DATA}
            hashes = [image_hash(im) for im in images]
            made = self._items(proc, ids, runs, len(images), tensors, hashes)
            return ids, [MultiModalItem("image", o, n, h, d) for o, n, h, d in made]
        spans = _split_runs(runs, len(images))
        if spans is None:
            raise ValueError(
                f"the prompt expands to {sum(n for _, n in runs)} image tokens in {len(runs)} run(s) for "
                f"{len(images)} image(s); each image needs its own placeholder"
            )
        tensors = {k: v for k, v in out.items() if k not in _NOT_IMAGE_DATA}
        patches = _patch_slices(tensors)
        items = []
        for i, ((offset, length), image) in enumerate(zip(spans, images)):
            data = {k: _one(v, i, len(images)) for k, v in tensors.items()}
            if patches is not None:  # the images' patches, concatenated (Qwen-VL)
                data["pixel_values"] = tensors["pixel_values"][patches[i] : patches[i + 1]]
            items.append(MultiModalItem("image", offset, length, image_hash(image), data))
        if video_parts or (self.video_token_id is not None and self.video_token_id in ids):
            items += _video_items(ids, self.video_token_id, videos or [], video_parts)
            items.sort(key=lambda it: it.offset)
        return ids, items


def _video_items(ids: list[int], token_id: int, videos: list, parts: list[list[dict]]) -> list[MultiModalItem]:
    """One item per run of video tokens: a video's data dicts in order (a video may be
    several runs, e.g. one per frame group with timestamps between)."""
    runs = image_token_runs(ids, token_id)
    flat = [(video, k, len(datas), data) for video, datas in zip(videos, parts) for k, data in enumerate(datas)]
    if len(runs) != len(flat):
        raise ValueError(
            f"the prompt holds {len(runs)} run(s) of video tokens for {len(flat)} expected from its "
            f"{len(videos)} video(s); video tokens may only come from video placeholders"
        )
    items = []
    for (offset, length), (video, k, count, data) in zip(runs, flat):
        key = video.hash if count == 1 else f"{video.hash}:{k}"
        items.append(MultiModalItem("video", offset, length, key, data))
    return items


#: Processor outputs that are not an image's data.
_NOT_IMAGE_DATA = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def _split_runs(runs: list[tuple[int, int]], num_images: int) -> list[tuple[int, int]] | None:
    """One (offset, length) span per image: the runs themselves, or adjacent images'
    merged runs split equally (fixed-size images, e.g. LLaVA's)."""
    if len(runs) == num_images:
        return runs
    total = sum(n for _, n in runs)
    if num_images == 0 or total % num_images:
        return None
    per = total // num_images
    spans = []
    for offset, n in runs:
        if n % per:
            return None
        spans += [(offset + k * per, per) for k in range(n // per)]
    return spans


def _one(value, index: int, count: int):
    """Image ``index``'s slice of a processor output batched over ``count`` images."""
    if hasattr(value, "shape") and value.ndim and value.shape[0] == count:
        return value[index : index + 1]
    return value


def _patch_slices(tensors: dict) -> list[int] | None:
    """Each image's first row in ``pixel_values`` when the processor concatenates the
    images' patches (``image_grid_thw``: patches per image), else None."""
    grid = tensors.get("image_grid_thw")
    if grid is None or "pixel_values" not in tensors:
        return None
    counts = grid.prod(dim=-1).tolist()
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    return bounds
