"""LLaVA-NeXT (anyres tiles, unpadding, a newline per row) through ``LLM`` against
transformers' ``LlavaNextForConditionalGeneration``, float32: greedy tokens and logprobs
for images whose aspect ratios pick different tile grids, two images per prompt, with
chunked prefill splitting their spans and prefix caching on."""

from __future__ import annotations

import math

import pytest

from pagedserve import LLM, SamplingParams

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from pagedserve.testing.tiny_vlm import build_llava_next, hf_greedy, random_image  # noqa: E402


@pytest.fixture(scope="module")
def llava_next_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava-next")
    return folder, build_llava_next(folder)


def test_llava_next_matches_transformers(llava_next_dir):
    folder, model = llava_next_dir
    cases = [
        ("Wide <image> then tall <image>.", [random_image(3, (80, 30)), random_image(4, (20, 60))]),
        ("Square-ish <image> only", [random_image(5, (33, 33))]),
        ("Landscape <image>", [random_image(6, (52, 40))]),
    ]
    llm = LLM(
        str(folder),
        dtype="float32",
        kv_cache_memory=2**22,
        max_model_len=512,
        max_num_batched_tokens=24,
        block_size=4,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
        prompts = [{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in cases]
        outs = llm.generate(prompts, params, use_tqdm=False)
        lengths = set()
        for (prompt, imgs), out in zip(cases, outs):
            ids, tokens, logprobs = hf_greedy(model, folder, prompt, imgs, 6)
            lengths.add(len(ids))
            assert out.prompt_token_ids == ids
            got = out.outputs[0]
            assert list(got.token_ids) == tokens, prompt
            for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
                assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (prompt, j)
        assert len(lengths) == 3  # the grids (and so the token counts) differ
    finally:
        llm.shutdown()
