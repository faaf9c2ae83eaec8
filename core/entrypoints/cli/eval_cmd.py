"""`pagedserve eval kl`: how far a model's next-token distributions are from a reference's.

The measure llama.cpp's ``llama-perplexity --kl-divergence`` reports, on the same terms so
that the two can be set side by side: the text is tokenized once (by the reference's
tokenizer), cut into chunks of ``--ctx`` tokens (the first replaced by BOS when the
tokenizer adds one), and each chunk's second half is scored -- positions ``ctx/2 ..
ctx-2``, each predicting the next token with the first half as context.  Per scored
position: the KL divergence of the model's distribution from the reference's,
``sum p_ref * (log p_ref - log p_model)``, both models' negative log-likelihood of the
actual next token (perplexity), and whether their most likely tokens agree.

Both engines run in this process, chunk batch by chunk batch, so that no more than one
batch of full distributions (``[ctx/2, vocab]`` float32 per chunk and model) is held.
They come from ``SamplingParams(prompt_logprobs=-1)``, the engine's full prompt
distributions; the model's own forward path (kept quantized blocks, bf16 activations,
native kernels) is the one measured.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["add_parser", "run", "KLReport", "KLAccumulator", "chunk_tokens", "evaluate_kl"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="evaluate a model against a reference (KL divergence, perplexity)")
    sub = p.add_subparsers(dest="eval_command", metavar="EVAL", required=True)
    kl = sub.add_parser("kl", help="KL divergence and perplexity of MODEL against REFERENCE over a text")
    kl.add_argument("--model", required=True, help="the model measured (a folder or .gguf file)")
    kl.add_argument("--reference", required=True, help="the full-precision reference (a folder or .gguf file)")
    kl.add_argument("--text", required=True, help="a UTF-8 text file")
    kl.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama.cpp's -c; default 512)")
    kl.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    kl.add_argument("--batch", type=int, default=2, help="chunks per engine call (default 2)")
    kl.add_argument("--dtype", default="auto", help="the model's activation dtype (default: its default)")
    kl.add_argument("--reference-dtype", default="float32", help="the reference's dtype (default float32)")
    kl.add_argument(
        "--residual-dtype",
        default="auto",
        help="the model's residual stream dtype: auto, float32 or model (default auto)",
    )
    kl.add_argument("--quantization", default=None, help="the model's quantization method (default: from the file)")
    kl.add_argument("--threads", type=int, default=None, help="CPU threads of both engines")
    kl.add_argument("--json", default=None, help="also write the report as JSON to this file")


@dataclass
class KLReport:
    """What ``llama-perplexity --kl-divergence`` prints, for pagedserve's engine."""

    model: str
    reference: str
    ctx: int
    chunks: int
    positions: int
    mean_kld: float
    mean_kld_stderr: float
    median_kld: float
    p99_kld: float
    max_kld: float
    ppl_model: float
    ppl_reference: float
    ppl_ratio: float
    top1_agreement: float
    seconds: float

    def table(self) -> str:
        rows = [
            ("chunks x scored positions", f"{self.chunks} x {self.positions // max(self.chunks, 1)}"),
            ("mean KLD", f"{self.mean_kld:.6f} +/- {self.mean_kld_stderr:.6f}"),
            ("median KLD", f"{self.median_kld:.6f}"),
            ("99% KLD", f"{self.p99_kld:.6f}"),
            ("max KLD", f"{self.max_kld:.6f}"),
            ("PPL(model)", f"{self.ppl_model:.4f}"),
            ("PPL(reference)", f"{self.ppl_reference:.4f}"),
            ("PPL ratio", f"{self.ppl_ratio:.4f}"),
            ("same top-1", f"{100 * self.top1_agreement:.2f}%"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


class KLAccumulator:
    """Per-position KL, NLLs and top-1 agreement, added one chunk at a time."""

    def __init__(self) -> None:
        self.kld: list[torch.Tensor] = []
        self.nll_model = 0.0
        self.nll_reference = 0.0
        self.same_top1 = 0
        self.count = 0

    def add(self, ref_lp: torch.Tensor, model_lp: torch.Tensor, targets: torch.Tensor) -> None:
        """ref_lp, model_lp float32 ``[n, vocab]`` log-distributions of the same positions;
        targets int64 ``[n]`` the tokens that came next."""
        if ref_lp.shape != model_lp.shape:
            raise ValueError(
                f"the distributions differ in shape: reference {tuple(ref_lp.shape)}, model {tuple(model_lp.shape)}"
            )
        ref64, model64 = ref_lp.double(), model_lp.double()
        self.kld.append((ref64.exp() * (ref64 - model64)).sum(dim=-1).clamp_min(0.0))
        idx = targets.unsqueeze(1)
        self.nll_reference -= float(ref64.gather(1, idx).sum())
        self.nll_model -= float(model64.gather(1, idx).sum())
        self.same_top1 += int((ref_lp.argmax(dim=-1) == model_lp.argmax(dim=-1)).sum())
        self.count += int(targets.numel())

    def report(self, model: str, reference: str, ctx: int, chunks: int, seconds: float) -> KLReport:
        if not self.count:
            raise ValueError("nothing was scored: the text is shorter than one chunk (--ctx)")
        kld = torch.cat(self.kld)
        n = kld.numel()
        std = float(kld.std()) if n > 1 else 0.0
        ppl_m, ppl_r = math.exp(self.nll_model / n), math.exp(self.nll_reference / n)
        return KLReport(
            model,
            reference,
            ctx,
            chunks,
            n,
            float(kld.mean()),
            std / math.sqrt(n),
            float(kld.median()),
            float(torch.quantile(kld, 0.99)),
            float(kld.max()),
            ppl_m,
            ppl_r,
            ppl_m / ppl_r,
            self.same_top1 / n,
            seconds,
        )


def chunk_tokens(ids: list[int], ctx: int, bos: int | None, limit: int | None = None) -> list[list[int]]:
    """Whole chunks of ``ctx`` tokens (the rest is dropped), each starting with ``bos``
    when the tokenizer adds one, as llama-perplexity cuts them."""
    if ctx < 4:
        raise ValueError(f"--ctx must be at least 4, got {ctx}")
    chunks = [list(ids[i : i + ctx]) for i in range(0, len(ids) - ctx + 1, ctx)]
    if limit is not None:
        chunks = chunks[:limit]
    if bos is not None:
        for c in chunks:
            c[0] = bos
    return chunks


def _distributions(llm, chunks: list[list[int]], first: int) -> list[torch.Tensor]:
    """Per chunk: float32 ``[ctx - 1 - first, vocab]``, the distributions of positions
    ``first .. ctx - 2`` (each predicting the token after it)."""
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    return [o.prompt_logprob_rows[first:] for o in outs]


def evaluate_kl(model_llm, reference_llm, ids: list[int], ctx: int, bos: int | None, **kw) -> KLReport:
    """The report of ``model_llm`` against ``reference_llm`` over token ids ``ids``.
    Keywords: chunks (limit), batch, model/reference (names for the report), progress
    (a callable taking (done, total))."""
    chunks = chunk_tokens(ids, ctx, bos, kw.get("chunks"))
    first = ctx // 2
    acc = KLAccumulator()
    batch = max(1, int(kw.get("batch", 2)))
    progress = kw.get("progress")
    t0 = time.perf_counter()
    for lo in range(0, len(chunks), batch):
        part = chunks[lo : lo + batch]
        refs = _distributions(reference_llm, part, first)
        models = _distributions(model_llm, part, first)
        for c, r, m in zip(part, refs, models):
            acc.add(r, m, torch.tensor(c[first + 1 :], dtype=torch.int64))
        if progress is not None:
            progress(min(lo + batch, len(chunks)), len(chunks))
    return acc.report(
        kw.get("model", "model"), kw.get("reference", "reference"), ctx, len(chunks), time.perf_counter() - t0
    )


def run(args: argparse.Namespace) -> int:
    from pagedserve import LLM
    from pagedserve.platforms import PlatformError

    text = Path(args.text).read_text(encoding="utf-8")
    common = {"max_model_len": args.ctx + 1, "enable_prefix_caching": False, "max_num_seqs": max(1, args.batch)}
    if args.threads is not None:
        common["threads"] = args.threads
    model_kw = dict(common, dtype=args.dtype, residual_dtype=args.residual_dtype)
    if args.quantization is not None:
        model_kw["quantization"] = args.quantization
    try:
        reference = LLM(model=args.reference, dtype=args.reference_dtype, **common)
        model = LLM(model=args.model, **model_kw)
    except (ValueError, PlatformError) as e:
        raise SystemExit(f"pagedserve eval kl: {e}") from None
    tok = reference.get_tokenizer()
    ids = tok.encode(text)  # with the tokenizer's own special tokens (BOS where it adds one)
    bos_id = getattr(tok, "bos_token_id", None)
    bos = bos_id if ids and bos_id is not None and ids[0] == bos_id else None

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total} chunks", end="", file=sys.stderr, flush=True)

    try:
        report = evaluate_kl(
            model,
            reference,
            ids,
            args.ctx,
            bos,
            chunks=args.chunks,
            batch=args.batch,
            model=args.model,
            reference=args.reference,
            progress=progress,
        )
    except ValueError as e:
        raise SystemExit(f"pagedserve eval kl: {e}") from None
    print(file=sys.stderr)
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0
