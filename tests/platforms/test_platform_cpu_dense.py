"""The CPU platform's dense linear: bf16 weights packed once at load, for the native
packed kernel where it is built, else for oneDNN."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import reference
from pagedserve.kernels.cpu import load_cpu_kernels
from pagedserve.platforms.cpu import dense_ops

pytestmark = pytest.mark.skipif(not dense_ops.prepack_enabled(), reason="this torch has no oneDNN weight packing")


def _native():
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.has_packed_linear:
        pytest.skip("the native kernels have no packed linear here (no AVX-512 BF16)")
    return kernels


def _is_packed(t: torch.Tensor) -> bool:
    return t.is_mkldnn or t.dim() == 4


@pytest.mark.parametrize("rows", [1, 3, 44, 300])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_packed_linear_matches_torch_and_reference(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 160, generator=gen) / 160**0.5).bfloat16()
    x = torch.randn(rows, 160, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    packed = dense_ops.prepare_linear_weight(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    linear = dense_ops.make_linear(reference.linear)
    got = linear(x, packed, b)
    # oneDNN computes either way: identical to torch's own bf16 linear ...
    assert torch.equal(got, torch.nn.functional.linear(x, w, b))
    # ... and within bf16 rounding of the float32 reference.
    want = reference.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)


def test_views_other_dtypes_and_plain_weights():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=gen).bfloat16()
    packed = dense_ops.prepare_linear_weight(w)
    linear = dense_ops.make_linear(reference.linear)
    wide = torch.randn(5, 100, generator=gen).bfloat16()
    x = wide[:, :64]  # a row-strided view
    assert torch.equal(linear(x, packed), torch.nn.functional.linear(x, w))
    x3 = torch.randn(2, 3, 64, generator=gen).bfloat16()
    assert torch.equal(linear(x3, packed), torch.nn.functional.linear(x3, w))
    xf = torch.randn(4, 64, generator=gen)  # another activation dtype: unpacked, still right
    torch.testing.assert_close(linear(xf, packed), reference.linear(xf, w.float()))
    wf = torch.randn(32, 64, generator=gen)
    assert dense_ops.prepare_linear_weight(wf) is wf  # only bf16 is packed
    assert torch.equal(linear(xf, wf), reference.linear(xf, wf))


@pytest.mark.parametrize("rows", [1, 6, 44, 300])
def test_native_packing_and_fallbacks(rows):
    """Natively packed where N % 16 == 0 and K % 2 == 0, oneDNN-packed otherwise; both
    through the same linear, equal to the reference within bf16 rounding."""
    native = _native()
    prepare, linear = dense_ops.make_prepare_linear_weight(native), dense_ops.make_linear(reference.linear, native)
    gen = torch.Generator().manual_seed(rows)
    for n, k in [(96, 160), (90, 160), (96, 161)]:
        w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
        b = torch.randn(n, generator=gen).bfloat16()
        x = torch.randn(rows, k, generator=gen).bfloat16()
        packed = prepare(w)
        assert (packed.dim() == 4) == (n % 16 == 0 and k % 2 == 0) and _is_packed(packed)
        want = reference.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(linear(x, packed, b).float(), want, atol=2e-2, rtol=1.6e-2)
    assert prepare(torch.randn(32, 64)).dim() == 2  # float32 stays plain


def _generate(path, monkeypatch, prepack: str, tune: str = "0", **kw):
    monkeypatch.setenv("PAGEDSERVE_CPU_PREPACK", prepack)
    monkeypatch.setenv("PAGEDSERVE_CPU_TUNE", tune)
    llm = LLM(model=str(path), dtype="bfloat16", device="cpu", kv_cache_memory="16MiB", **kw)
    prompts = [[5, 17, 99, 3, 41, 7], [8, 8, 120, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return llm.llm_engine.runner.model, [list(o.outputs[0].token_ids) for o in outs]


def test_engine_packs_dense_weights_and_keeps_outputs(tiny_checkpoint_factory, monkeypatch):
    path = tiny_checkpoint_factory(tie_word_embeddings=True)
    model, packed_ids = _generate(path, monkeypatch, "1")
    for layer in model.layers:
        assert all(_is_packed(getattr(layer, n)) for n in ("qkv", "o", "gate_up", "down"))
    # The tied LM head is packed separately; the embedding stays plain for lookups.
    assert _is_packed(model.lm_head) and not _is_packed(model.embed) and model.embed.dim() == 2
    plain_model, plain_ids = _generate(path, monkeypatch, "0")
    assert not _is_packed(plain_model.layers[0].qkv)
    assert packed_ids == plain_ids


def test_engine_with_tuned_linears_keeps_outputs(tiny_checkpoint_factory, monkeypatch):
    """With measured dispatch (the default) every dense weight carries its route, and the
    greedy outputs equal those of plain weights through torch."""
    # Every dense weight at least TUNE_MIN_ELEMENTS (the LM head: 259 x 256).
    path = tiny_checkpoint_factory(tie_word_embeddings=True, hidden_size=256, intermediate_size=512)
    model, tuned_ids = _generate(path, monkeypatch, "1", tune="1")
    for layer in model.layers:
        assert all(hasattr(getattr(layer, n), "_pagedserve_route") for n in ("qkv", "o", "gate_up", "down"))
    assert hasattr(model.lm_head, "_pagedserve_route") and model.embed.dim() == 2
    _, plain_ids = _generate(path, monkeypatch, "0")
    assert tuned_ids == plain_ids


def test_weight_offload_keeps_plain_weights(tiny_checkpoint_factory, monkeypatch):
    path = tiny_checkpoint_factory(tie_word_embeddings=True)
    model, ids = _generate(path, monkeypatch, "1", cpu_offload_gb=0.001)
    assert not any(_is_packed(t) for layer in model.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    _, plain_ids = _generate(path, monkeypatch, "0")
    assert ids == plain_ids
