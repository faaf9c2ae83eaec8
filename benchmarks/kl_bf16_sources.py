"""Which bfloat16 rounding of the GGUF path adds KL divergence: variants of one file's
forward pass scored against the same float32 reference, as `pagedserve eval kl` scores them.

    python benchmarks/kl_bf16_sources.py [--chunks 6] [--gguf FILE] [VARIANT ...]

Variants (default: all, in this order):

=====================  ================================================================
``bf16``               ``residual_dtype="model"``: bf16 activations, residual stream and
                       KV cache (the default path before the float32 stream)
``auto``               the default path (``residual_dtype="auto"``): bf16 activations and
                       KV cache, the residual stream in float32 with the o and down
                       projections writing their float32 sums into it
``f32``                ``dtype="float32"``: every activation and the KV cache in float32
``res32``              bf16 activations, but the residual stream kept in float32 (each
                       sublayer's bf16 output added to it unrounded; the RMSNorm computed
                       from it in float32, its output rounded to bf16 once)
``res32_out32``        as ``res32``, and the o and down projections' outputs in float32
                       (their int8 kernel fed float32 activations of the same values, so
                       it writes float32) straight into the float32 stream
``res32_out32_emb32``  as ``res32_out32``, and the embedding rows dequantized to float32
=====================  ================================================================

The weights and the int8 activation blocks are the same in every variant, so the
differences are the bf16 roundings alone.  The ``res32*`` variants replace the Llama
layer's forward for the run (a measurement, not a supported path; the Llama family
only, without tensor parallelism); ``res32_out32`` is what ``auto`` implements.  The
reference is benchmarks/workloads.py's bf16 folder of the default model in float32, the
text /usr/share/common-licenses/GPL-3, chunks of 512 tokens, their second halves scored.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import sys
import time
from dataclasses import asdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
from workloads import default_gguf_path, prepare_model_dir  # noqa: E402

VARIANTS = ("bf16", "f32", "res32", "res32_out32", "res32_out32_emb32", "auto")
#: The residual_dtype setting of each variant (the res32 ones replace the layer's forward).
RESIDUAL = {"auto": "auto", "f32": "auto"}
TEXT = pathlib.Path("/usr/share/common-licenses/GPL-3")
CTX = 512


def _norm32(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, dtype: torch.dtype):
    """(rms_norm(x + residual) in ``dtype``, the float32 stream x + residual)."""
    r = x.float() if residual is None else residual + x.float()
    h = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return h.to(dtype), r


def _patches(flags: set[str]):
    """The replaced methods of the Llama decoder for ``flags`` (see the module docstring)."""
    from pagedserve.models.layers import linear, paged_attention, qkv_split

    out32 = "out32" in flags

    def layer_forward(self, ops, placement, index, layer, kv_cache, x, residual, meta):
        eps = self.cfg.rms_norm_eps
        h, residual = _norm32(x, residual, layer.input_norm, eps, self.dtype)
        q, k, v = qkv_split(linear(ops, h, layer.qkv, layer.qkv_bias), self.attn)
        if self.rope_layers[index]:
            q, k = self.rope(ops, placement, meta.positions, q, k)
        attn = paged_attention(ops, q, k, v, kv_cache, meta, self.attn.scale, self.windows[index])
        attn = attn.reshape(attn.shape[0], -1)
        x = linear(ops, attn.float() if out32 else attn, layer.o)
        h, residual = _norm32(x, residual, layer.post_norm, eps, self.dtype)
        g = layer.gate_up.apply_silu_and_mul(h, ops.silu_and_mul)
        return linear(ops, g.float() if out32 else g, layer.down), residual

    def final_norm(self, x, residual):
        return _norm32(x, residual, self.norm, self.cfg.rms_norm_eps, self.dtype)[0]

    return layer_forward, final_norm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="*", help=f"some of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--gguf", default=None, help="the GGUF file (default: the default model's)")
    args = p.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)} (known: {', '.join(VARIANTS)})")
    args.variants = args.variants or list(VARIANTS)

    from pagedserve import LLM
    from pagedserve.entrypoints.cli.eval_cmd import KLAccumulator, _distributions, chunk_tokens
    from pagedserve.models import decoder, llama
    from pagedserve.quantization import QuantizedWeight

    model = args.gguf or str(default_gguf_path())
    common = dict(max_model_len=CTX + 1, enable_prefix_caching=False, max_num_seqs=2)
    ref = LLM(model=str(prepare_model_dir()), dtype="float32", **common)
    tok = ref.get_tokenizer()
    ids = tok.encode(TEXT.read_text(encoding="utf-8"))
    bos_id = getattr(tok, "bos_token_id", None)
    chunks = chunk_tokens(ids, CTX, bos_id if ids and ids[0] == bos_id else None, args.chunks)
    first = CTX // 2
    refs = [d for lo in range(0, len(chunks), 2) for d in _distributions(ref, chunks[lo : lo + 2], first)]
    del ref
    gc.collect()

    cls, base = llama.LlamaForCausalLM, decoder.DecoderForCausalLM
    saved = (cls.layer_forward, base.final_norm, base.embed_tokens)

    def embed32(self, input_ids):
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.embedding(input_ids, torch.float32)
        return saved[2](self, input_ids)

    print(f"{model}; {len(chunks)} chunks of {CTX} ({len(chunks) * (CTX - 1 - first)} positions), text {TEXT}\n")
    print("| variant | mean KLD | +- | 99% KLD | PPL ratio | same top-1 | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.variants:
        flags = set(name.split("_"))
        try:
            if "res32" in flags:
                cls.layer_forward, base.final_norm = _patches(flags)
            if "emb32" in flags:
                base.embed_tokens = embed32
            residual = RESIDUAL.get(name, "model")
            llm = LLM(model=model, dtype="float32" if name == "f32" else "auto", residual_dtype=residual, **common)
            acc, t0 = KLAccumulator(), time.perf_counter()
            for lo in range(0, len(chunks), 2):
                part = chunks[lo : lo + 2]
                for i, (c, d) in enumerate(zip(part, _distributions(llm, part, first))):
                    acc.add(refs[lo + i], d, torch.tensor(c[first + 1 :], dtype=torch.int64))
            r = asdict(acc.report(name, "reference", CTX, len(chunks), time.perf_counter() - t0))
        finally:
            cls.layer_forward, base.final_norm, base.embed_tokens = saved
        print(
            f"| {name} | {r['mean_kld']:.5f} | {r['mean_kld_stderr']:.5f} | {r['p99_kld']:.4f} | {r['ppl_ratio']:.4f} "
            f"| {100 * r['top1_agreement']:.2f}% | {r['seconds']:.0f} |",
            flush=True,
        )
        del llm
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
