"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): greedy continuations equal
transformers' greedy output on the same GGUF file, both in float32."""

from __future__ import annotations

from hf_reference import hf_greedy, load_hf

from pagedserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]
MAX_NEW = 24


# Long (about 90 s on 2 cores) but the one full-vocabulary reference check: runs in CI.
def test_default_model_greedy_matches_transformers(default_model_hf_dir):
    # Dequantized like transformers loads the file (kept blocks are tested in tests/quantization).
    llm = LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048, quantization="none")
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(
        prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False
    )
    got = [o.outputs[0].token_ids for o in outs]
    hf = load_hf(str(default_model_hf_dir))  # transformers' reading of the GGUF file (tests/conftest.py)
    expected = [hf_greedy(hf, ids, MAX_NEW) for ids in prompt_ids]
    assert got == expected
    assert "Paris" in tok.decode(got[0])
    assert llm.llm_engine.kv.pool.num_in_use == 0
