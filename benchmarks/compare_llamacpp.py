"""pagedserve against llama.cpp's llama-server on the default model's own GGUF file.

    python benchmarks/compare_llamacpp.py                         # the full comparison
    python benchmarks/compare_llamacpp.py --batch-sizes 1,4 --workloads none --output-len 16
    python benchmarks/compare_llamacpp.py --agreement-only        # greedy agreement alone

llama-server is built from source (benchmarks/README.md) and never becomes a dependency of
pagedserve. Every engine runs the same seeded token-id workloads, one engine at a time:

    batch-N   N requests of 128 prompt + 128 output tokens, all submitted at once (N in
              --batch-sizes, default 1, 4, 16, 64)
    fixed     64 x 128 + 128;  mixed  48 requests, 16-1024 prompt + 16-512 output tokens

on these engines:

    pagedserve-gguf   pagedserve on the GGUF file (the default model path)
    pagedserve-bf16   pagedserve on the bf16 folder converted from it (as compare_vllm.py)
    llamacpp-gguf     llama-server on the GGUF file
    llamacpp-bf16     llama-server on a BF16 GGUF of the same weights (--bf16-gguf; by
                      default written once by gguf_bf16.py from the GGUF file)

pagedserve runs in a fresh process through engine_runner.py (`LLM.generate` over all the
requests of a workload). llama-server gets `-t/-tb --threads`, continuous batching and one
slot per request (`-np N -c N*ctx`), and all N requests at once through `/completion`
(token ids, `n_predict`, `ignore_eos`, temperature 0, `cache_prompt: false`). Throughput
is output tokens over the wall time of the whole workload, in the steady state: each engine
first runs the first workload's first request whole (pagedserve once per process, after a
one-token warm-up; llama-server once per server), untimed in the table, so that batch-1 is
not an engine's first request; pagedserve's first request is printed and kept in the JSON
(`first_request`, with its CPU seconds and thread facts) as what a first request costs.

Agreement (issue 23's rule): greedy outputs of --agreement-tokens tokens for 16 chat
prompts (pagedserve's tokenizer and chat template, sent as token ids), with the top-k
logprobs at every position (`n_probs` / `logprobs`); the mean matched prefix of
pagedserve-gguf against llama.cpp at -t 2 and -t 1, of llama.cpp -t 1 against -t 2, and
of llama.cpp -t 2 against itself with --agreement-llama-variant (default `-fa off`: its
attention without flash attention, a second measure of its own numeric spread, since
its outputs do not depend on the thread count at all). Each pair also reports the mean
largest |logprob difference| over the positions both share, and at each first
divergence the logprob gap between the two tokens under either engine: gaps well under
those logprob differences mean the outputs part at near-ties, not at a real difference.
llama-server's `ignore_eos` never picks an end-of-generation token (a -inf bias), so
pagedserve gets the same bias on the same tokens (`eog_masked` in the JSON); before, a
prompt where pagedserve chose EOS showed as a negative gap.
`--agreement-only` runs only this (about a minute on an idle machine). llama.cpp's
threads spin while waiting: run this on an idle machine. Writes
bench_results/compare_llamacpp-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from engine_runner import launch, machine_info, workload_digest  # noqa: E402
from gguf_bf16 import write_bf16_gguf  # noqa: E402
from servers import DEFAULT_LLAMA_SERVER, ServerProcess, free_port, llama_server_cmd  # noqa: E402
from workloads import default_gguf_path, make_workload, prepare_model_dir, read_vocab_size  # noqa: E402

_HERE = pathlib.Path(__file__).resolve().parent

# Held-out-style chat prompts for the agreement measure (none is in any test).
AGREEMENT_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse in winter.",
    "What is the difference between a list and a tuple in Python?",
    "Give three tips for keeping houseplants alive.",
    "Summarize the plot of a heist movie you invent, in one paragraph.",
    "How do vaccines train the immune system?",
    "Translate 'Where is the train station?' into French and Spanish.",
    "List the planets of the solar system in order from the sun.",
    "What should I pack for a three-day hiking trip?",
    "Describe how a binary search works.",
    "Why do cats purr?",
    "Write a short, polite email declining a meeting invitation.",
    "What are the main causes of inflation?",
    "Suggest a name for a bakery that sells only bread.",
    "How does a refrigerator keep food cold?",
    "Tell me a fun fact about octopuses.",
]


def _workloads(args) -> list[tuple[str, dict]]:
    """(label, engine_runner workload spec) for every workload of the run."""
    out = [
        (f"batch-{b}", {"name": "fixed", "num_requests": b, "input_len": args.input_len, "output_len": args.output_len})
        for b in args.batch_sizes
    ]
    out += [(n, {"name": n, "num_requests": None, "input_len": None, "output_len": None}) for n in args.workloads]
    for _, spec in out:
        spec["seed"] = args.seed
    return out


def _make(spec: dict, vocab: int):
    return make_workload(spec["name"], vocab, spec["seed"], spec["num_requests"], spec["input_len"], spec["output_len"])


async def _complete_all(url: str, bodies: list[dict], timeout: float) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def one(body: dict) -> dict:
            r = await client.post(url + "/completion", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"llama-server answered {r.status_code}: {r.text[:300]}")
            return r.json()

        return await asyncio.gather(*(one(b) for b in bodies))


def _body(prompt: list[int], n: int, tokens: bool = False) -> dict:
    return {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": tokens,
    }


def run_llamacpp(args, model: pathlib.Path, label: str, workloads, out: pathlib.Path) -> dict:
    """One llama-server per workload, sized to it (one slot per request); returns per-workload runs."""
    runs = []
    for name, w in workloads:
        ctx = max(len(r.prompt_token_ids) + r.max_tokens for r in w.requests) + 16
        port = free_port()
        cmd = llama_server_cmd(
            args.llama_server, model, port, args.threads, len(w.requests), ctx, args.llama_args.split()
        )
        with ServerProcess(
            f"llama-server ({label})", cmd, port, out.with_name(f"{out.stem}-{label}-{name}.log")
        ) as srv:
            first = workloads[0][1].requests[0]
            # As for pagedserve (engine_runner's first_request): one whole request before the timed one.
            asyncio.run(_complete_all(srv.url, [_body(first.prompt_token_ids, first.max_tokens)], args.timeout))
            bodies = [_body(r.prompt_token_ids, r.max_tokens) for r in w.requests]
            load = os.getloadavg()
            t0 = time.perf_counter()
            answers = asyncio.run(_complete_all(srv.url, bodies, args.timeout))
            elapsed = time.perf_counter() - t0
        tokens = sum(int(a["tokens_predicted"]) for a in answers)
        runs.append(
            {
                "label": name,
                "digest": workload_digest(w),
                "elapsed_s": elapsed,
                "output_tokens": tokens,
                "expected_output_tokens": w.num_output_tokens,
                "output_tokens_per_s": tokens / elapsed,
                "server_startup_s": srv.startup_s,
                "loadavg_before": load,
            }
        )
        print(f"  {label:16s} {name:9s} {tokens / elapsed:8.1f} output tokens/s (load avg {load[0]:.1f})", flush=True)
    return {"engine": label, "model": str(model), "command": cmd, "runs": runs}


def run_pagedserve(args, label: str, model: str, dtype: str, model_dir, vocab, wspecs, workloads, out) -> dict:
    spec = {
        "model_dir": str(model_dir),
        "model": model,
        "dtype": dtype,
        "vocab_size": vocab,
        "threads": args.threads,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_gib": args.kv_cache_gib,
        # batch-N and fixed share seeded prompts and llama-server runs with cache_prompt
        # false: no prefix-cache hits across workloads.
        "enable_prefix_caching": False,
        # The first workload's first request runs whole (and is reported) before the timed
        # workloads: the batch-1 figure is the steady state, not the engine's first request.
        "first_request": True,
        "workloads": [s for _, s in wspecs],
    }
    result = launch(
        "pagedserve", args.pagedserve_python, spec, out.with_name(f"{out.stem}-{label}.log"), None, args.timeout
    )
    first = result.get("first_request")
    if first is not None:
        print(
            f"  {label:16s} {'first':9s} {first['output_tokens_per_s']:8.1f} output tokens/s (the engine's first "
            f"request, {first['prompt_tokens']} + {first['output_tokens']} tokens, untimed in the table)",
            flush=True,
        )
    for (name, w), run in zip(workloads, result["runs"]):
        if run["digest"] != workload_digest(w):
            raise RuntimeError(f"{label} ran a different {name} workload")
        run["label"] = name
        print(f"  {label:16s} {name:9s} {run['output_tokens_per_s']:8.1f} output tokens/s", flush=True)
    return {"engine": label, "model": model, "dtype": dtype, **result}


def _matched(a: list[int], b: list[int]) -> int:
    return sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(a, b)))


def _gap(top: dict[int, float], mine: int, other: int) -> tuple[float, bool]:
    """logprob(mine) - logprob(other) under one engine's top-k at a position; with `other`
    outside its top-k, the gap to its last listed token (a lower bound: True); NaN when the
    engine's own token is missing from its own list (seen with llama-server on a random-weight
    model, whose distributions are nearly flat)."""
    if mine not in top:
        return float("nan"), True
    if other in top:
        return top[mine] - top[other], False
    return top[mine] - min(top.values()), True


def _pair(a: list[dict], b: list[dict]) -> dict:
    """Matched prefixes of two engines' greedy outputs ({"tokens", "top"} per prompt), and at
    each first divergence how far apart the two tokens are under either engine."""
    m = [_matched(x["tokens"], y["tokens"]) for x, y in zip(a, b)]
    margins = []
    for x, y, k in zip(a, b, m):
        if k < min(len(x["tokens"]), len(y["tokens"])):
            ta, tb = x["tokens"][k], y["tokens"][k]
            ga, la = _gap(x["top"][k], ta, tb)
            gb, lb = _gap(y["top"][k], tb, ta)
            margins.append({"position": k, "a": ga, "a_lower_bound": la, "b": gb, "b_lower_bound": lb})
    return {
        "mean_matched_prefix": sum(m) / len(m),
        "identical": sum(x["tokens"] == y["tokens"] for x, y in zip(a, b)),
        "per_prompt": m,
        "divergence_margins": margins,
        "max_abs_logprob_diff": _logprob_diff(a, b, m),
    }


def _logprob_diff(a: list[dict], b: list[dict], matched: list[int]) -> float:
    """Mean over positions up to and with the first divergence (same context on both) of
    the largest |logprob difference| over the tokens both engines list there."""
    diffs = []
    for x, y, k in zip(a, b, matched):
        for j in range(min(k + 1, len(x["top"]), len(y["top"]))):
            both = x["top"][j].keys() & y["top"][j].keys()
            if both:
                diffs.append(max(abs(x["top"][j][t] - y["top"][j][t]) for t in both))
    return sum(diffs) / len(diffs) if diffs else float("nan")


def _llamacpp_outputs(args, gguf, prompts, n, threads: int, extra: list[str], log: pathlib.Path) -> list[dict]:
    """Greedy tokens and top-k logprobs per position from one llama-server, a prompt at a time."""
    port = free_port()
    cmd = llama_server_cmd(args.llama_server, gguf, port, threads, 1, 2048, args.llama_args.split() + extra)
    out = []
    with ServerProcess(f"llama-server -t {threads} {' '.join(extra)}", cmd, port, log) as srv:
        for p in prompts:
            body = {**_body(p, n, True), "n_probs": args.agreement_top_k}
            a = asyncio.run(_complete_all(srv.url, [body], args.timeout))[0]
            top = [
                {int(t["id"]): float(t["logprob"]) for t in c["top_logprobs"]} for c in a["completion_probabilities"]
            ]
            out.append({"tokens": list(a["tokens"]), "top": top})
    return out


def _pagedserve_outputs(args, gguf, prompts, n, eog: list[int]) -> list[dict]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=str(gguf), dtype=args.gguf_dtype, threads=args.threads, seed=args.seed)
    # llama-server's ignore_eos puts a -inf bias on every end-of-generation token, so that
    # it never picks one; pagedserve's (vLLM's) only keeps going after one.  The same bias
    # here, so that both choose among the same tokens (logprobs stay the raw model's).
    params = SamplingParams(
        temperature=0.0,
        max_tokens=n,
        ignore_eos=True,
        logprobs=args.agreement_top_k,
        logit_bias=dict.fromkeys(eog, -100.0),
    )
    res = llm.generate(prompts, params, use_tqdm=False)
    out = []
    for r in res:
        top = [{int(t): float(lp.logprob) for t, lp in d.items()} for d in r.outputs[0].logprobs]
        out.append({"tokens": list(r.outputs[0].token_ids), "top": top})
    del llm
    return out


# Texts llama.cpp's vocabulary loader marks as end of generation (besides the file's ids).
LLAMA_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<|return|>")


def _print_pair(key: str, r: dict, n: int) -> None:
    gaps = sorted(round(min(g["a"], g["b"]), 3) for g in r["divergence_margins"])
    near = sum(g < 0.25 for g in gaps)
    print(
        f"  {key:40s} mean matched prefix {r['mean_matched_prefix']:5.1f} / {n}, identical {r['identical']:2d}, "
        f"mean max|dlogprob| {r['max_abs_logprob_diff']:.3f}; logprob gaps at the first divergence "
        f"(smaller of the two engines'): {gaps} ({near} of {len(gaps)} under 0.25)"
    )


def agreement(args, gguf: pathlib.Path, out: pathlib.Path) -> dict:
    """Greedy outputs and top-k logprobs of pagedserve-gguf, llama.cpp -t 2, -t 1 and -t 2
    with --agreement-llama-variant; matched prefixes, logprob differences and the gaps at
    the first divergences of each pair."""
    from pagedserve.loader import open_model

    source = open_model(str(gguf))
    tok = source.tokenizer()
    # llama.cpp's end-of-generation tokens: the file's EOS / EOT / EOM ids and the special
    # tokens it recognises by their text.
    eog = list(source.eos_token_ids)
    for text in LLAMA_EOG_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ids[0] not in eog:
            eog.append(ids[0])
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
        for p in AGREEMENT_PROMPTS[: args.agreement_prompts]
    ]
    n = args.agreement_tokens
    variant = args.agreement_llama_variant.split()
    runs = {"llamacpp-t2": (2, []), "llamacpp-t1": (1, [])}
    if variant:
        runs[f"llamacpp-t2 {' '.join(variant)}"] = (2, variant)
    outputs: dict[str, list[dict]] = {}
    for i, (name, (threads, extra)) in enumerate(runs.items()):
        log = out.with_name(f"{out.stem}-agree-{i}.log")
        outputs[name] = _llamacpp_outputs(args, gguf, prompts, n, threads, extra, log)
    outputs["pagedserve-gguf"] = _pagedserve_outputs(args, gguf, prompts, n, eog)
    report: dict = {"num_prompts": len(prompts), "max_tokens": n, "top_k": args.agreement_top_k, "eog_masked": eog}
    pairs = [("pagedserve-gguf", "llamacpp-t2"), ("pagedserve-gguf", "llamacpp-t1"), ("llamacpp-t1", "llamacpp-t2")]
    pairs += [("llamacpp-t2", name) for name in list(outputs)[2:-1]]
    for a, b in pairs:
        key = f"{a} vs {b}"
        report[key] = _pair(outputs[a], outputs[b])
        _print_pair(key, report[key], n)
    report["outputs"] = outputs
    return report


RATIOS = (
    ("pagedserve-gguf", "llamacpp-gguf"),
    ("pagedserve-gguf", "pagedserve-bf16"),
    ("pagedserve-bf16", "llamacpp-bf16"),
    ("pagedserve-gguf", "llamacpp-bf16"),
)


def print_table(engines: dict[str, dict], labels: list[str]) -> dict:
    """Output tokens/s per workload and engine, and same-run ratios; returns the ratios."""
    names = list(engines)
    ratios = [(a, b) for a, b in RATIOS if a in engines and b in engines]
    short = {"pagedserve-gguf": "ps-gguf", "pagedserve-bf16": "ps-bf16", "llamacpp-gguf": "ll-gguf"}
    short["llamacpp-bf16"] = "ll-bf16"
    head = "".join(f"{n:>17s}" for n in names) + "".join(f"{short[a] + '/' + short[b]:>18s}" for a, b in ratios)
    print(f"\noutput tokens/s (same run)\n{'workload':10s}{head}")
    table: dict[str, dict] = {}
    for i, label in enumerate(labels):
        tps = {n: engines[n]["runs"][i]["output_tokens_per_s"] for n in names}
        row = {f"{a}/{b}": tps[a] / tps[b] for a, b in ratios}
        table[label] = {"tokens_per_s": tps, "ratios": row}
        print(f"{label:10s}" + "".join(f"{tps[n]:17.1f}" for n in names) + "".join(f"{v:17.2f}x" for v in row.values()))
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER, help="the llama-server binary")
    p.add_argument("--llama-args", default="", help="extra llama-server flags, space-separated")
    p.add_argument("--gguf", type=pathlib.Path, default=None, help="default: the default model's own GGUF file")
    p.add_argument("--gguf-dtype", default="auto", help="pagedserve's --dtype on the GGUF (auto: the default path)")
    p.add_argument(
        "--bf16-gguf", default="auto", help="BF16 GGUF for llama.cpp: a path, none, or auto (gguf_bf16.py, made once)"
    )
    p.add_argument("--no-bf16", action="store_true", help="skip pagedserve on the bf16 folder")
    p.add_argument("--batch-sizes", type=ints, default=[1, 4, 16, 64])
    p.add_argument("--workloads", default="fixed,mixed", help="comma-separated workloads.py names, or none")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the batch-N workloads")
    p.add_argument("--output-len", type=int, default=128, help="output tokens of the batch-N workloads")
    p.add_argument("--agreement-prompts", type=int, default=16)
    p.add_argument("--agreement-tokens", type=int, default=64)
    p.add_argument("--agreement-top-k", type=int, default=5, help="logprobs per position (both engines)")
    p.add_argument(
        "--agreement-llama-variant",
        default="-fa off",
        help="llama-server flags of a third llama.cpp run (-t 2) to measure its own numeric spread; '' for none",
    )
    p.add_argument("--agreement-only", action="store_true", help="only the agreement measure (no throughput workloads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=pathlib.Path, default=None, help="bf16 folder (default: converted once)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--pagedserve-python", default=sys.executable)
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    args.workloads = [] if args.workloads == "none" else args.workloads.split(",")
    if not pathlib.Path(args.llama_server).is_file():
        p.error(f"--llama-server {args.llama_server} does not exist (build it: benchmarks/README.md)")
    if not args.batch_sizes and not args.workloads:
        p.error("nothing to run: give --batch-sizes or --workloads")
    if not 1 <= args.agreement_prompts <= len(AGREEMENT_PROMPTS):
        p.error(f"--agreement-prompts must be 1-{len(AGREEMENT_PROMPTS)} (0 is not a measure)")
    return args


def main_agreement(args) -> int:
    """--agreement-only: the agreement measure alone (about a minute on an idle machine)."""
    gguf = args.gguf or default_gguf_path()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or _HERE.parent / "bench_results" / f"compare_llamacpp-agreement-{stamp}.json"
    settings = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
    report = {"machine": machine_info(), "gguf": str(gguf), "settings": settings, "loadavg": os.getloadavg()}
    print("agreement of greedy outputs ...", flush=True)
    report["agreement"] = agreement(args, gguf, out)
    report["loadavg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.agreement_only:
        return main_agreement(args)
    model_dir = prepare_model_dir(args.model_dir)
    vocab = read_vocab_size(model_dir)
    gguf = args.gguf or default_gguf_path()
    wspecs = _workloads(args)
    workloads = [(name, _make(s, vocab)) for name, s in wspecs]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or _HERE.parent / "bench_results" / f"compare_llamacpp-{stamp}.json"
    report = {
        "machine": machine_info(),
        "gguf": str(gguf),
        "model_dir": str(model_dir),
        "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "workloads": {n: {**w.describe(), "digest": workload_digest(w)} for n, w in workloads},
        "engines": {},
    }
    bf16_gguf = None if args.bf16_gguf == "none" else pathlib.Path(args.bf16_gguf)
    if args.bf16_gguf == "auto":
        bf16_gguf = model_dir.with_name(model_dir.name + ".gguf")
        if not bf16_gguf.is_file() or bf16_gguf.stat().st_mtime < gguf.stat().st_mtime:
            print(f"writing {bf16_gguf} (BF16 copy of {gguf.name}) ...", flush=True)
            write_bf16_gguf(gguf, bf16_gguf)
    eng = report["engines"]
    print("running pagedserve-gguf ...", flush=True)
    eng["pagedserve-gguf"] = run_pagedserve(
        args, "pagedserve-gguf", str(gguf), args.gguf_dtype, model_dir, vocab, wspecs, workloads, out
    )
    if not args.no_bf16:
        print("running pagedserve-bf16 ...", flush=True)
        eng["pagedserve-bf16"] = run_pagedserve(
            args, "pagedserve-bf16", str(model_dir), "bfloat16", model_dir, vocab, wspecs, workloads, out
        )
    print("running llamacpp-gguf ...", flush=True)
    eng["llamacpp-gguf"] = run_llamacpp(args, gguf, "llamacpp-gguf", workloads, out)
    if bf16_gguf is not None:
        print("running llamacpp-bf16 ...", flush=True)
        eng["llamacpp-bf16"] = run_llamacpp(args, bf16_gguf, "llamacpp-bf16", workloads, out)
    for name, e in eng.items():
        for run in e["runs"]:
            if run["output_tokens"] != run["expected_output_tokens"]:
                print(f"warning: {name} {run['label']}: {run['output_tokens']} of {run['expected_output_tokens']}")
    report["table"] = print_table(eng, [n for n, _ in workloads])
    print("\nagreement of greedy outputs ...", flush=True)
    report["agreement"] = agreement(args, gguf, out)
    report["loadavg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
