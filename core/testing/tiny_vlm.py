"""Tiny random vision-language checkpoints with their processors saved beside them
(the byte-level test tokenizer plus an image placeholder token, and transformers'
PIL image processor), and the transformers reference they are compared with.  Used by
the tests; needs transformers and Pillow."""

from __future__ import annotations

import base64
import io
import json
import pathlib

import numpy as np
import torch
import transformers
from PIL import Image

from pagedserve.testing.tiny_model import write_byte_tokenizer

__all__ = [
    "IMAGE_TOKEN",
    "TEMPLATE",
    "build_llava",
    "save_random_model",
    "build_llava_next",
    "build_qwen2_5_vl",
    "build_qwen3_vl",
    "build_gemma3",
    "hf_greedy_gemma3",
    "GEMMA3_IMAGE",
    "build_smolvlm",
    "hf_greedy_smolvlm",
    "hf_greedy_qwen",
    "random_image",
    "png_data_uri",
    "hf_greedy",
    "png_bytes",
]

IMAGE_TOKEN = "<image>"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_image_token(folder: pathlib.Path) -> int:
    """Add ``<image>`` as a special token to the folder's byte tokenizer; its id."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True)])
    tok.save(str(folder / "tokenizer.json"))
    return tok.token_to_id(IMAGE_TOKEN)


def init_weights(model, seed: int = 0) -> None:
    """Wider-than-default random weights (greedy choices are not near-ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "embed" in name else 0.08))
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # class embeddings
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def save_random_model(model_class, cfg, folder: pathlib.Path):
    """``model_class(cfg)`` with :func:`init_weights`' random weights, float32 in eval
    mode, saved to ``folder`` as safetensors; returns the model (the transformers reference)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(cfg)
    init_weights(model)
    model.to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
VISION = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=28,
    patch_size=7,
    projection_dim=32,
    hidden_act="quick_gelu",
)


def build_llava(folder: pathlib.Path, text_type: str = "llama", **extra):
    """A tiny LLaVA checkpoint (16 image tokens per image) and processor in ``folder``;
    returns the float32 transformers model."""
    folder.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(folder)
    image_id = add_image_token(folder)
    text = dict(TEXT, model_type=text_type, vocab_size=image_id + 1)
    cfg = transformers.LlavaConfig(
        text_config=text,
        vision_config=VISION,
        image_token_index=image_id,
        projector_hidden_act="gelu",
        vision_feature_layer=extra.pop("vision_feature_layer", -2),
        vision_feature_select_strategy=extra.pop("vision_feature_select_strategy", "default"),
        **extra,
    )
    model = save_random_model(transformers.LlavaForConditionalGeneration, cfg, folder)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    size = VISION["image_size"]
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=VISION["patch_size"],
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(folder)
    return model


def build_llava_next(folder: pathlib.Path, text_type: str = "llama"):
    """A tiny LLaVA-NeXT checkpoint (anyres tiles of 28 px: 1x2, 2x1 and 2x2 grids) and
    processor in ``folder``; returns the float32 transformers model."""
    folder.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(folder)
    image_id = add_image_token(folder)
    size = VISION["image_size"]
    pinpoints = [[size, 2 * size], [2 * size, size], [2 * size, 2 * size]]
    cfg = transformers.LlavaNextConfig(
        text_config=dict(TEXT, model_type=text_type, vocab_size=image_id + 1),
        vision_config=VISION,
        image_token_index=image_id,
        projector_hidden_act="gelu",
        image_grid_pinpoints=pinpoints,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = save_random_model(transformers.LlavaNextForConditionalGeneration, cfg, folder)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, image_grid_pinpoints=pinpoints
    )
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=VISION["patch_size"],
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=TEMPLATE,
    )
    processor.save_pretrained(folder)
    return model


QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_qwen2_5_vl(folder: pathlib.Path):
    """A tiny Qwen2.5-VL checkpoint and processor in ``folder``: 4-pixel patches merged
    2x2 (an image's tokens: its resized height and width / 8, multiplied), windows of 2x2
    merged patches, full attention in vision layer 1 of 3; returns the float32
    transformers model."""
    start, _end, image_id, video_id = _qwen_tokenizer(folder)
    text = dict(
        TEXT,
        vocab_size=video_id + 1,
        head_dim=16,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]},
        rope_theta=10000.0,
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        out_hidden_size=TEXT["hidden_size"],
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=16,
        fullatt_block_indexes=[1],
    )
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=start,
        tie_word_embeddings=False,
    )
    model = save_random_model(transformers.Qwen2_5_VLForConditionalGeneration, cfg, folder)
    _save_qwen_processor(folder)
    return model


def _qwen_tokenizer(folder: pathlib.Path) -> tuple[int, int, int, int]:
    """The byte tokenizer with Qwen-VL's vision tokens; their ids (start, end, image, video)."""
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in QWEN_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    return tuple(tok.token_to_id(t) for t in QWEN_TOKENS)


def _save_qwen_processor(folder: pathlib.Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8 * 4, max_pixels=48 * 48
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    fast.chat_template = TEMPLATE
    # The processor itself is rebuilt from these two (its video processor needs torchvision).
    image_processor.save_pretrained(folder)
    fast.save_pretrained(folder)


def build_qwen3_vl(folder: pathlib.Path, moe: bool = False):
    """A tiny Qwen3-VL checkpoint and processor in ``folder``: 4-pixel patches merged 2x2,
    a 4x4 grid of learned position embeddings (resampled to every image's grid), 3 vision
    layers of which 0 and 2 feed DeepStack features into decoder layers 0 and 1 (of 3),
    interleaved M-RoPE with a section that leaves the last two frequencies temporal; returns the
    float32 transformers model.  ``moe``: Qwen3-VL-MoE instead (4 experts, top 2, layer 1
    dense)."""
    start, end, image_id, video_id = _qwen_tokenizer(folder)
    text = dict(
        TEXT,
        num_hidden_layers=3,
        vocab_size=video_id + 1,
        head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        out_hidden_size=TEXT["hidden_size"],
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 2],
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
    config_class = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    cfg = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    model_class = (
        transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    )
    model = save_random_model(model_class, cfg, folder)
    _save_qwen_processor(folder)
    return model


GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
#: What a Gemma 3 prompt holds once per image (the processor expands it).
GEMMA3_IMAGE = GEMMA3_TOKENS[0]


def build_gemma3(folder: pathlib.Path, tokens_per_image: int = 16, sliding_window: int = 6):
    """A tiny Gemma 3 checkpoint and processor in ``folder``: a SigLIP tower over 32-pixel
    images of 4-pixel patches (8 x 8), pooled to ``tokens_per_image`` tokens; a decoder of
    a sliding-window layer (``sliding_window`` tokens, shorter than an image) and a
    full-attention one, head size 64 (a native attention kernel's); returns the float32
    transformers model."""
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in GEMMA3_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    boi, eoi, image_id = (tok.token_to_id(t) for t in GEMMA3_TOKENS)
    text = dict(
        TEXT,
        model_type="gemma3_text",
        vocab_size=image_id + 1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        rms_norm_eps=1e-6,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=4,
        vision_use_head=False,
    )
    cfg = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tokens_per_image,
        image_token_index=image_id,
        boi_token_index=boi,
        eoi_token_index=eoi,
        tie_word_embeddings=False,
    )
    model = save_random_model(transformers.Gemma3ForConditionalGeneration, cfg, folder)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        extra_special_tokens={
            "boi_token": GEMMA3_TOKENS[0],
            "eoi_token": GEMMA3_TOKENS[1],
            "image_token": GEMMA3_TOKENS[2],
        },
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=False)
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=fast, chat_template=TEMPLATE, image_seq_length=tokens_per_image
    )
    processor.save_pretrained(folder)
    return model


@torch.inference_mode()
def hf_greedy_gemma3(model, folder: pathlib.Path, prompt: str, images: list, max_new: int):
    """:func:`hf_greedy` for Gemma 3: the token types go with every full forward (text
    for the generated tokens), so transformers' mask lets each image's tokens see each
    other both ways."""
    from pagedserve.models.gemma3_vision import load_gemma3_processor

    processor = load_gemma3_processor(str(folder))
    enc = processor(text=[prompt], images=images or None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    extra = {"pixel_values": enc["pixel_values"]} if images else {}
    types = enc["token_type_ids"][0].tolist() if images else None
    return greedy_loop(model, ids, extra, max_new, types, "token_type_ids")


SMOLVLM_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>")


def build_smolvlm(folder: pathlib.Path, idefics3: bool = False):
    """A tiny SmolVLM (or Idefics3) checkpoint and processor in ``folder``: 32-pixel tiles
    of 4-pixel patches (8 x 8), pixel-shuffled 2 x 2 into 16 tokens per tile; images
    resized to at most 64 pixels a side and split into up to 2 x 2 tiles plus the global
    view; a Llama decoder.  Returns the float32 transformers model."""
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in SMOLVLM_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    image_id = tok.token_to_id(SMOLVLM_TOKENS[0])
    vision = dict(
        model_type="idefics3_vision" if idefics3 else "smolvlm_vision",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=4,
    )
    config_cls = transformers.Idefics3Config if idefics3 else transformers.SmolVLMConfig
    model_cls = (
        transformers.Idefics3ForConditionalGeneration if idefics3 else transformers.SmolVLMForConditionalGeneration
    )
    cfg = config_cls(
        text_config=dict(TEXT, model_type="llama", vocab_size=tok.get_vocab_size()),
        vision_config=vision,
        image_token_id=image_id,
        scale_factor=2,
        tie_word_embeddings=False,
    )
    model = save_random_model(model_cls, cfg, folder)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    if idefics3:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as Pil
    else:
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as Pil
    Pil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True).save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": 16}), encoding="utf-8")
    return model


@torch.inference_mode()
def hf_greedy_smolvlm(model, folder: pathlib.Path, prompt: str, images: list, max_new: int):
    """:func:`hf_greedy` for SmolVLM / Idefics3: the tiles and their pixel masks go with
    every full forward."""
    from pagedserve.models.smolvlm_vision import load_smolvlm_processor

    processor = load_smolvlm_processor(str(folder))
    enc = processor(text=[prompt], images=[images] if images else None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    extra = {k: enc[k] for k in ("pixel_values", "pixel_attention_mask") if k in enc} if images else {}
    return greedy_loop(model, ids, extra, max_new)


@torch.inference_mode()
def greedy_loop(model, ids: list[int], extra: dict, max_new: int, types: list[int] | None = None, types_key: str = ""):
    """(ids, greedy tokens, their logprobs) of ``model`` from the prompt ``ids``, one full
    forward per step with ``extra`` inputs; ``types`` (the processor's per-token type ids,
    passed as ``types_key``) grow with zeros for the generated tokens."""
    out_ids, tokens, logprobs = list(ids), [], []
    for _ in range(max_new):
        kw = dict(extra)
        if types is not None:
            kw[types_key] = torch.tensor([types + [0] * (len(out_ids) - len(types))])
        logits = model(input_ids=torch.tensor([out_ids]), **kw).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        out_ids.append(tok)
    return ids, tokens, logprobs


def random_image(seed: int, size: tuple[int, int] = (40, 52)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def png_data_uri(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


@torch.inference_mode()
def hf_greedy(model, folder: pathlib.Path, prompt: str, images: list, max_new: int):
    """transformers' greedy tokens and their logprobs (one full forward per step), and
    the prompt's ids as its processor expands them."""
    processor = transformers.AutoProcessor.from_pretrained(str(folder))
    enc = processor(text=[prompt], images=images or None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    extra = {k: enc[k] for k in ("pixel_values", "image_sizes") if k in enc} if images else {}
    return greedy_loop(model, ids, extra, max_new)


@torch.inference_mode()
def hf_greedy_qwen(
    model, folder: pathlib.Path, prompt: str, images: list, max_new: int, processor_class: str | None = None
):
    """:func:`hf_greedy` for Qwen2.5-VL / Qwen3-VL: the image grids and the token types
    (text for the generated tokens) go with every full forward, so transformers computes
    the M-RoPE positions of the whole sequence each step.  ``processor_class``: the
    transformers processor (default: the model's, Qwen2_5_VLProcessor or Qwen3VLProcessor)."""
    from pagedserve.models.qwen2_5_vl import load_qwen_vl_processor

    if processor_class is None:
        qwen3 = isinstance(
            model, (transformers.Qwen3VLForConditionalGeneration, transformers.Qwen3VLMoeForConditionalGeneration)
        )
        processor_class = "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor"
    processor = load_qwen_vl_processor(str(folder), processor_class)
    enc = processor(text=[prompt], images=images or None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    extra = {k: enc[k] for k in ("pixel_values", "image_grid_thw") if k in enc} if images else {}
    types = enc["mm_token_type_ids"][0].tolist() if images else None
    return greedy_loop(model, ids, extra, max_new, types, "mm_token_type_ids")
