"""Quality of quantized GGUF files as KL divergence from the full-precision model:
pagedserve's `eval kl` beside llama.cpp's `llama-perplexity --kl-divergence`, on the same
files, the same text and the same context.

    python benchmarks/kl_divergence.py                              # the package's Q4_1 file
    python benchmarks/kl_divergence.py --quantize Q4_K_M,Q8_0       # also files made by llama-quantize
    python benchmarks/kl_divergence.py --gguf some.gguf --no-llama  # pagedserve alone

The reference is the bf16 folder benchmarks/workloads.py writes (the package's Q4_1
weights dequantized, then rounded to bf16: the only float form of the default model's
weights at hand), run in float32 by pagedserve and, for llama.cpp, an F32 GGUF of the same
folder written by llama.cpp's own convert_hf_to_gguf.py (--f32-gguf; `--convert` writes
it: needs `sentencepiece` in the Python that runs it, --convert-python; or
`gguf_bf16.py DEFAULT.gguf F32.gguf --f32`, the same values without the converter).  The Q4_1 row
therefore measures what an engine's Q4_1 path adds beyond the weights themselves
(activation quantization, accumulation order, bf16 rounding of the weights); files made
by llama-quantize from the F32 GGUF (--quantize) measure their own quantization on top.
llama.cpp is built as benchmarks/README.md says, with the
targets llama-perplexity and llama-quantize; on a CPU with AMX tiles it runs with
--no-repack (servers.llama_cpu_flags).  Both engines cut the text into --ctx token chunks
and score each chunk's second half.  Writes bench_results/kl_divergence-<time>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from engine_runner import machine_info  # noqa: E402
from servers import llama_cpu_flags  # noqa: E402
from workloads import default_gguf_path, prepare_model_dir  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
LLAMA_DIR = pathlib.Path("/work/llamacpp")
DEFAULT_TEXT = pathlib.Path("/usr/share/common-licenses/GPL-3")

_LLAMA_FIELDS = {
    "ppl_model": r"Mean PPL\(Q\)\s*:\s*([\d.]+)",
    "ppl_reference": r"Mean PPL\(base\)\s*:\s*([\d.]+)",
    "ppl_ratio": r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([\d.]+)",
    "mean_kld": r"Mean\s+KLD:\s*([\d.]+)",
    "mean_kld_stderr": r"Mean\s+KLD:\s*[\d.]+\s*±\s*([\d.]+)",
    "max_kld": r"Maximum KLD:\s*([\d.]+)",
    "p99_kld": r"99\.0%\s+KLD:\s*([\d.]+)",
    "median_kld": r"Median\s+KLD:\s*([\d.]+)",
    "top1_agreement": r"Same top p:\s*([\d.]+)",
}


def parse_llama_perplexity(text: str) -> dict[str, float]:
    """The KL and perplexity statistics of llama-perplexity's --kl-divergence output."""
    out = {}
    for key, pattern in _LLAMA_FIELDS.items():
        m = re.search(pattern, text)
        if m is None:
            raise ValueError(f"llama-perplexity printed no {key!r} ({pattern}); its output ends:\n{text[-2000:]}")
        out[key] = float(m.group(1))
    out["top1_agreement"] /= 100.0
    return out


def _run(cmd: list[str], log: pathlib.Path) -> str:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}; log: {log}\n{(proc.stdout + proc.stderr)[-1500:]}")
    return proc.stdout + proc.stderr


def pagedserve_kl(model: pathlib.Path, reference: pathlib.Path, args, work: pathlib.Path) -> dict:
    out = work / f"pagedserve-{model.stem}.json"
    cmd = [ROOT / ".venv/bin/pagedserve", "eval", "kl", "--model", model, "--reference", reference]
    cmd += ["--text", args.text, "--ctx", args.ctx, "--threads", args.threads, "--json", out]
    if args.chunks:
        cmd += ["--chunks", args.chunks]
    _run(cmd, work / f"pagedserve-{model.stem}.log")
    return json.loads(out.read_text())


def llama_kl(model: pathlib.Path, base: pathlib.Path, args, work: pathlib.Path) -> dict:
    binary = pathlib.Path(args.llama_bin) / "llama-perplexity"
    base_kld = work / f"{base.stem}-c{args.ctx}.kld"
    common = ["-f", args.text, "-c", args.ctx, "-t", args.threads, "-b", args.ctx, *llama_cpu_flags()]
    if args.chunks:
        common += ["--chunks", args.chunks]
    if not base_kld.exists():
        _run([binary, "-m", base, *common, "--kl-divergence-base", base_kld], work / "llama-base.log")
    text = _run(
        [binary, "-m", model, *common, "--kl-divergence-base", base_kld, "--kl-divergence"],
        work / f"llama-{model.stem}.log",
    )
    return parse_llama_perplexity(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default=str(DEFAULT_TEXT), help=f"a UTF-8 text file (default {DEFAULT_TEXT})")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gguf", action="append", default=[], help="another GGUF file to measure (repeatable)")
    p.add_argument("--quantize", default="", help="comma-separated llama-quantize types made from the F32 GGUF")
    p.add_argument("--f32-gguf", default=str(LLAMA_DIR / "smollm2-f32.gguf"))
    p.add_argument("--convert", action="store_true", help="write --f32-gguf with llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--convert-python", default=sys.executable, help="the Python that runs the converter")
    p.add_argument("--llama-src", default=str(LLAMA_DIR / "llama_cpp_python-0.3.36/vendor/llama.cpp"))
    p.add_argument("--llama-bin", default=str(LLAMA_DIR / "build/bin"))
    p.add_argument("--no-llama", action="store_true", help="pagedserve alone")
    args = p.parse_args()

    reference = prepare_model_dir()
    work = ROOT / "bench_results" / "kl"
    work.mkdir(parents=True, exist_ok=True)
    f32 = pathlib.Path(args.f32_gguf)
    if args.convert and not f32.exists():
        script = pathlib.Path(args.llama_src) / "convert_hf_to_gguf.py"
        _run([args.convert_python, script, reference, "--outtype", "f32", "--outfile", f32], work / "convert.log")
    files = [pathlib.Path(default_gguf_path()), *map(pathlib.Path, args.gguf)]
    for qtype in filter(None, args.quantize.split(",")):
        target = work / f"smollm2-{qtype}.gguf"
        if not target.exists():
            _run([pathlib.Path(args.llama_bin) / "llama-quantize", f32, target, qtype], work / f"quantize-{qtype}.log")
        files.append(target)
    if not args.no_llama and not f32.exists():
        raise SystemExit(f"{f32} is missing: pass --convert (or --no-llama)")

    rows = []
    for f in files:
        row = {"file": f.name, "size_bytes": f.stat().st_size}
        try:
            row["pagedserve"] = pagedserve_kl(f, reference, args, work)
        except RuntimeError as e:
            row["pagedserve_error"] = str(e).splitlines()[0]
        if not args.no_llama:
            try:
                row["llama.cpp"] = llama_kl(f, f32, args, work)
            except (RuntimeError, ValueError) as e:
                row["llama.cpp_error"] = str(e).splitlines()[0]
        rows.append(row)

    print(f"\ntext {args.text}, ctx {args.ctx}, threads {args.threads}; reference: bf16 weights in float32\n")
    print("| file | engine | mean KLD | 99% KLD | PPL ratio | same top-1 | mean KLD vs llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        ll = row.get("llama.cpp")
        for engine in ("pagedserve", "llama.cpp"):
            r = row.get(engine)
            if r is None:
                err = row.get(f"{engine}_error")
                if err:
                    print(f"| {row['file']} | {engine} | failed: {err} | | | | |")
                continue
            ratio = f"{r['mean_kld'] / ll['mean_kld']:.2f}x" if ll and engine == "pagedserve" and ll["mean_kld"] else ""
            print(
                f"| {row['file']} | {engine} | {r['mean_kld']:.5f} | {r['p99_kld']:.5f} | {r['ppl_ratio']:.4f} "
                f"| {100 * r['top1_agreement']:.2f}% | {ratio} |"
            )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    result = {"machine": machine_info(), "args": vars(args), "rows": rows, "load": os.getloadavg()}
    path = ROOT / "bench_results" / f"kl_divergence-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
