"""Videos for Qwen2.5-VL and Qwen3-VL: the frames' patches (from the PIL image processor;
transformers' video processors need torchvision) against a hand-derived layout, and the
models through ``LLM`` against transformers float32 given those patches (greedy tokens
and logprobs): Qwen2.5-VL's temporal M-RoPE steps (tokens_per_second x seconds per
temporal patch), Qwen3-VL's per-frame-group timestamps and DeepStack, a video beside an
image, chunked prefill with prefix caching (a second request with the same video skips
the encoder); chat ``video_url`` parts (animated GIF); limits and bad videos."""

from __future__ import annotations

import base64
import io
import math
import re

import numpy as np
import pytest
import torch
from vlm_checks import QWEN_IMAGE

from pagedserve import LLM, SamplingParams
from pagedserve.models.qwen2_5_vl import load_qwen_vl_processor, qwen_video_patches
from pagedserve.multimodal.limits import MediaLimits
from pagedserve.multimodal.video import check_video, load_video_bytes
from pagedserve.testing.tiny_vlm import random_image

transformers = pytest.importorskip("transformers")

IMAGE = QWEN_IMAGE
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def _frames(seed: int, count: int, size=(40, 52)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, size[1], size[0], 3), dtype=np.uint8)


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def _llm(folder, **kw) -> LLM:
    return LLM(str(folder), dtype="float32", kv_cache_memory=2**22, max_model_len=384, **kw)


def test_video_patches_hand_derived():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8 * 4, max_pixels=48 * 48
    )
    video = check_video(_frames(1, 3), MediaLimits())
    pixels, (t, h, w) = qwen_video_patches(proc, video.frames, 2)
    assert t == 2  # 3 frames padded with the last to 4
    per_frame = [proc(images=[f], return_tensors="pt")["pixel_values"].view(h * w, 3, 2, 16) for f in video.frames]
    for p in per_frame:  # an image's patch holds its frame in both temporal slots
        assert torch.equal(p[:, :, 0], p[:, :, 1])
    got = pixels.view(t, h * w, 3, 2, 16)
    frame_of = [[0, 1], [2, 2]]  # temporal patch g, slot s
    for g in range(t):
        for s in range(2):
            assert torch.equal(got[g, :, :, s], per_frame[frame_of[g][s]][:, :, s])
    # A still video (one frame twice) is that frame's image patches.
    still = check_video([video.frames[0]] * 2, MediaLimits())
    image = proc(images=[video.frames[0]], return_tensors="pt")["pixel_values"]
    assert torch.equal(qwen_video_patches(proc, still.frames, 2)[0], image)


@torch.inference_mode()
def _hf_greedy(model, ids: list[int], extra: dict, image_id: int, video_id: int, n: int):
    types = [1 if t == image_id else 2 if t == video_id else 0 for t in ids]
    cur, tokens, logprobs = list(ids), [], []
    for _ in range(n):
        kw = dict(extra, mm_token_type_ids=torch.tensor([types + [0] * (len(cur) - len(types))]))
        lp = torch.log_softmax(model(input_ids=torch.tensor([cur]), **kw).logits[0, -1].float(), dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        cur.append(tok)
    return tokens, logprobs


def _check(out, tokens, logprobs, where):
    got = out.outputs[0]
    assert list(got.token_ids) == tokens, where
    for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
        assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (where, j)


def _case(folder, model, qwen3: bool):
    """A prompt with an image and a 4-frame video at 1 fps: (prompt, data, expected ids,
    the transformers inputs)."""
    proc = load_qwen_vl_processor(str(folder), "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor")
    frames, image = _frames(5, 4), random_image(6, (36, 28))
    prompt = f"See {IMAGE} then {VIDEO} what moved?"
    pixels, (t, h, w) = qwen_video_patches(proc.image_processor, [*map(_pil, frames)], 2)
    enc = proc.image_processor(images=[image], return_tensors="pt")
    n_image = int(enc["image_grid_thw"].prod()) // 4
    per = h * w // 4
    if qwen3:  # frames 0,1 at 0 s and 1 s; 2,3 at 2 s and 3 s: each temporal patch at its mean time
        video_text = "".join(
            f"<{s} seconds><|vision_start|>{'<|video_pad|>' * per}<|vision_end|>" for s in ("0.5", "2.5")
        )
        expanded = prompt.replace("<|video_pad|>", video_text)
    else:
        expanded = prompt.replace("<|video_pad|>", "<|video_pad|>" * (t * per))
    expanded = expanded.replace("<|image_pad|>", "<|image_pad|>" * n_image)
    ids = proc.tokenizer(expanded)["input_ids"]
    extra = {
        "pixel_values": enc["pixel_values"],
        "image_grid_thw": enc["image_grid_thw"],
        "pixel_values_videos": pixels,
        "video_grid_thw": torch.tensor([[t, h, w]]),
    }
    if not qwen3:
        extra["second_per_grid_ts"] = torch.tensor([2.0])  # temporal patch of 2 frames at 1 fps
    data = {"image": [image], "video": (frames, {"fps": 1.0})}
    return prompt, data, ids, extra


def _pil(frame):
    from PIL import Image

    return Image.fromarray(frame)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_video_matches_transformers(family, qwen_vl_dir, qwen3_vl_dir):
    folder, model = qwen3_vl_dir if family == "qwen3-vl" else qwen_vl_dir
    qwen3 = family == "qwen3-vl"
    prompt, data, ids, extra = _case(folder, model, qwen3)
    cfg = model.config
    tokens, logprobs = _hf_greedy(model, ids, extra, cfg.image_token_id, cfg.video_token_id, 6)
    if not qwen3:  # the temporal positions step by tokens_per_second x 2 s (8): they matter
        slow = dict(extra, second_per_grid_ts=torch.tensor([0.5]))
        other = _hf_greedy(model, ids, slow, cfg.image_token_id, cfg.video_token_id, 1)
        assert abs(other[1][0] - logprobs[0]) > 1e-4
    llm = _llm(folder, max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4)
    cache = llm.llm_engine.runner.encoder_cache
    try:
        out = llm.generate({"prompt": prompt, "multi_modal_data": data}, _params(6), use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        _check(out, tokens, logprobs, family)
        runs = cache.encoder_runs
        assert runs == (1 + 2 if qwen3 else 1 + 1)  # the image, and the video (Qwen3-VL: per temporal patch)
        again = llm.generate({"prompt": prompt, "multi_modal_data": data}, _params(6), use_tqdm=False)[0]
        _check(again, tokens, logprobs, (family, "again"))
        assert cache.encoder_runs == runs and again.num_cached_tokens > len(ids) - 8
    finally:
        llm.shutdown()


def _gif(frames: np.ndarray, ms: int) -> bytes:
    images = [_pil(f) for f in frames]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=ms, loop=0)
    return buf.getvalue()


def test_chat_video_url_and_limits(qwen3_vl_dir, llava_dir):
    folder, _ = qwen3_vl_dir
    gif = _gif(_frames(8, 4, (32, 24)), 500)
    video = load_video_bytes(gif, MediaLimits())
    assert len(video.frames) == 4 and video.fps == 2.0
    llm = _llm(folder)
    try:
        uri = "data:image/gif;base64," + base64.b64encode(gif).decode()
        parts = [{"type": "text", "text": "What happens?"}, {"type": "video_url", "video_url": {"url": uri}}]
        chat = llm.chat([{"role": "user", "content": parts}], _params(4), use_tqdm=False)[0]
        prompt = "<|im_start|>user\nWhat happens?\n<|video_pad|><|im_end|>\n<|im_start|>assistant\n"
        frames = (video.frames, {"fps": 2.0})
        direct = llm.generate({"prompt": prompt, "multi_modal_data": {"video": frames}}, _params(4), use_tqdm=False)[0]
        assert chat.prompt_token_ids == direct.prompt_token_ids
        assert list(chat.outputs[0].token_ids) == list(direct.outputs[0].token_ids)
        stamp = load_qwen_vl_processor(str(folder), "Qwen3VLProcessor").tokenizer.encode(
            "<0.2 seconds>", add_special_tokens=False
        )
        assert any(direct.prompt_token_ids[i : i + len(stamp)] == stamp for i in range(len(direct.prompt_token_ids)))
        bad = [
            ({"video": [_frames(1, 2), _frames(2, 2)]}, f"{VIDEO}{VIDEO}", "at most 1 are accepted"),
            ({"video": _frames(1, 2)}, "no placeholder", "0 video placeholder(s)"),
            ({"video": [_pil(_frames(1, 1)[0]), random_image(3, (20, 20))]}, VIDEO, "share one size"),
            ({"video": "clip.mp4"}, VIDEO, "video files are not decoded"),
            ({"video": _frames(1, 300)}, VIDEO, "at most 256"),
        ]
        for data, text, message in bad:
            with pytest.raises(ValueError, match=re.escape(message)):
                llm.generate({"prompt": text, "multi_modal_data": data}, _params(1), use_tqdm=False)
        mp4 = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]
        with pytest.raises(ValueError, match="cannot be decoded by this server"):
            llm.chat([{"role": "user", "content": mp4}], _params(1), use_tqdm=False)
    finally:
        llm.shutdown()
    two = _llm(folder, limit_mm_per_prompt="image=1,video=2")
    try:
        out = two.generate(
            {"prompt": f"{VIDEO} and {VIDEO}", "multi_modal_data": {"video": [_frames(1, 2), _frames(2, 2)]}},
            _params(1),
            use_tqdm=False,
        )[0]
        assert len(out.outputs[0].token_ids) == 1
    finally:
        two.shutdown()
    llava = _llm(llava_dir[0])
    try:
        with pytest.raises(ValueError, match="takes no videos"):
            llava.generate({"prompt": "<image>", "multi_modal_data": {"video": _frames(1, 2)}}, _params(1))
    finally:
        llava.shutdown()
