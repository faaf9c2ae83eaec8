"""SmolVLM and Idefics3 images through ``LLM`` against transformers, float32: greedy
tokens and their logprobs for images split into different tile grids (the row/column
tokens the processor inserts, the global view last), two images and none, whole
prompts, chunked prefill with prefix caching (chunks split a tile's tokens) and forced
preemption; a follow-up turn reads the cached tiles and skips the encoder; the tower and
pixel-shuffle connector alone."""

from __future__ import annotations

import pytest
import torch
from vlm_checks import check_engine_matches, check_output, expected_greedy, greedy_params, make_llm

from pagedserve.testing.tiny_vlm import build_smolvlm, hf_greedy_smolvlm, random_image

transformers = pytest.importorskip("transformers")

IMAGE = "<image>"
# Resized to 64 pixels on the long side, then rounded up to whole 32-pixel tiles:
# 64 x 28 -> 1 x 2 tiles, 20 x 24 -> 2 x 2, 24 x 56 -> 2 x 1 (rows x columns), each
# with the global view last.
PROMPTS = [
    ("no picture here, just text", []),
    (f"A {IMAGE} wide one", [(4, (64, 28))]),
    (f"Look: {IMAGE} what is it?", [(1, (20, 24))]),
    (f"{IMAGE} and {IMAGE}, compare.", [(2, (60, 64)), (3, (24, 56))]),
]
MAX_NEW = [5, 6, 5, 4]
ENGINES = {
    "whole": dict(),
    "chunked+prefix": dict(max_num_batched_tokens=24, enable_prefix_caching=True, block_size=4),
    # 34 blocks of 8 tokens for 4 requests of 30-230 tokens: preemption is forced.
    "preempting": dict(
        max_num_batched_tokens=256, enable_prefix_caching=True, block_size=8, num_gpu_blocks_override=34
    ),
}


@pytest.fixture(scope="module", params=["smolvlm", "idefics3"])
def smolvlm_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, build_smolvlm(folder, idefics3=request.param == "idefics3")


def test_tile_embeddings_match_transformers(smolvlm_dir):
    folder, model = smolvlm_dir
    llm = make_llm(folder)
    try:
        runner = llm.llm_engine.runner
        proc = runner.vision.load_processor(str(folder))
        enc = proc(text=[IMAGE], images=[[random_image(7, (60, 64))]], return_tensors="pt")
        with torch.inference_mode():
            want = model.model.get_image_features(enc["pixel_values"], enc["pixel_attention_mask"]).pooler_output[0]
            tiles = enc["pixel_values"][0]
            got = torch.cat([runner.vision.embed_image({"pixel_values": tiles[k : k + 1]}) for k in range(5)])
        assert got.shape == want.shape == (5 * 16, 64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_matches_transformers(engine_kind, smolvlm_dir):
    folder, model = smolvlm_dir
    images, expected = expected_greedy(hf_greedy_smolvlm, model, folder, PROMPTS, MAX_NEW)
    check_engine_matches(folder, engine_kind, ENGINES[engine_kind], PROMPTS, images, expected, MAX_NEW)


def test_follow_up_turn_reads_cached_tiles(smolvlm_dir):
    folder, model = smolvlm_dir
    llm = make_llm(folder, max_num_batched_tokens=24, enable_prefix_caching=True, block_size=4)
    cache = llm.llm_engine.runner.encoder_cache
    try:
        img = random_image(11, (64, 28))  # 2 tiles and the global view
        first = f"Here {IMAGE} is a picture."
        llm.generate({"prompt": first, "multi_modal_data": {"image": [img]}}, greedy_params(3), use_tqdm=False)
        assert cache.encoder_runs == 3
        follow = first + " And now more text after it."
        again = llm.generate(
            {"prompt": follow, "multi_modal_data": {"image": [img]}}, greedy_params(4), use_tqdm=False
        )[0]
        check_output(again, *hf_greedy_smolvlm(model, folder, follow, [img], 4), "follow-up")
        assert cache.encoder_runs == 3
    finally:
        llm.shutdown()
