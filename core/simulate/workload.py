"""Simulated workloads: when requests arrive, how long their prompts and outputs are,
and which prompts share a prefix.

The flags are those of `pagedserve bench throughput` and `bench serve` (``--num-prompts``,
``--input-len``, ``--output-len``, ``--mixed``, ``--seed``, ``--request-rate``,
``--max-concurrency``), so a measured run and its prediction are one flag apart: with
the same flags the prompts are the very token ids those benchmarks send (their own
``make_workload``) and the arrival gaps the same seeded draws.  Beyond those:

* ``--burstiness K``: gamma-distributed gaps of shape K at the same mean rate (K = 1 is
  Poisson; K < 1 is burstier), as vLLM's ``bench serve --burstiness``;
* ``--input-dist/--output-dist fixed|uniform|lognormal`` around ``--input-len``/
  ``--output-len`` (``--*-len-range`` for uniform, ``--*-sigma`` for lognormal);
* ``--shared-prefix-len N --num-prefixes K``: each prompt starts with one of K shared
  N-token prefixes, so prefix caching can hit;
* ``--workload sharegpt``: lognormal lengths fitted to published ShareGPT statistics;
* ``--workload FILE.jsonl``: a trace, one object per line with ``arrival`` (seconds),
  ``prompt_len``, ``output_len`` and optional ``prefix_id``/``prefix_len``/``priority``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
from dataclasses import dataclass

__all__ = ["SimRequest", "add_workload_arguments", "build_workload", "arrival_times", "SHAREGPT"]

#: ShareGPT conversation lengths as published in the vLLM paper (Kwon et al., SOSP 2023,
#: section 6.1 / figure 11: mean input 161.31 and mean output 337.99 tokens).  The spread
#: (lognormal sigma) is not published there; 1.0 is our assumption (a long right tail).
SHAREGPT = {"input_mean": 161.31, "output_mean": 337.99, "sigma": 1.0, "max_len": 4096}

_MIN_ID = 100  # token ids avoid the first 100 (special tokens), as bench throughput's do


@dataclass
class SimRequest:
    arrival: float
    prompt_token_ids: list[int]
    output_len: int
    priority: int = 0


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (the flags of `bench throughput` / `bench serve`, plus distributions)")
    g.add_argument(
        "--workload", default=None, metavar="SPEC", help="fixed (default), mixed, sharegpt, or a JSONL trace file"
    )
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128, help="prompt length (mean for uniform/lognormal)")
    g.add_argument("--output-len", type=int, default=128, help="output length (mean for uniform/lognormal)")
    g.add_argument(
        "--mixed", action="store_true", help="bench throughput's mixed lengths (prompts 16-1024, outputs 16-512)"
    )
    g.add_argument("--input-dist", choices=["fixed", "uniform", "lognormal"], default="fixed")
    g.add_argument("--output-dist", choices=["fixed", "uniform", "lognormal"], default="fixed")
    g.add_argument(
        "--input-len-range", type=float, default=0.5, help="uniform: lengths in [len x (1 - r), len x (1 + r)]"
    )
    g.add_argument("--output-len-range", type=float, default=0.5)
    g.add_argument("--input-sigma", type=float, default=1.0, help="lognormal sigma of prompt lengths")
    g.add_argument("--output-sigma", type=float, default=1.0, help="lognormal sigma of output lengths")
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a shared prefix per prompt")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean arrivals per second (default inf: all at once, as bench throughput)",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (bench serve)")
    g.add_argument("--seed", type=int, default=0)


def _lengths(rng: random.Random, dist: str, mean: int, spread: float, sigma: float, cap: int) -> int:
    if dist == "fixed":
        n = mean
    elif dist == "uniform":
        n = rng.randint(max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread))))
    else:  # lognormal with the given mean: mu = ln(mean) - sigma^2 / 2
        n = round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))
    return max(1, min(n, cap))


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Arrival times: the first at 0, then seeded gaps (bench serve's own draws for K = 1)."""
    if not math.isfinite(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        # bench serve sleeps expovariate(rate) after each send; gamma(K, 1/(K rate)) has the same mean.
        t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, 1.0 / (burstiness * rate))
    return out


def _trace(path: pathlib.Path, vocab: int, seed: int, max_len: int) -> list[SimRequest]:
    rng = random.Random(seed)
    prefixes: dict[object, list[int]] = {}
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            arrival, n_in, n_out = float(rec["arrival"]), int(rec["prompt_len"]), int(rec["output_len"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{i}: need arrival, prompt_len, output_len ({e})") from e
        if n_in < 1 or n_out < 1 or arrival < 0:
            raise ValueError(f"{path}:{i}: lengths must be >= 1 and arrival >= 0")
        if n_in + n_out > max_len:
            raise ValueError(f"{path}:{i}: prompt_len + output_len = {n_in + n_out} exceeds max_model_len {max_len}")
        ids: list[int] = []
        if rec.get("prefix_id") is not None:
            plen = min(int(rec.get("prefix_len", n_in // 2)), n_in - 1)
            pre = prefixes.setdefault(rec["prefix_id"], [])
            while len(pre) < plen:
                pre.append(rng.randrange(_MIN_ID, vocab))
            ids = pre[:plen]
        ids = ids + [rng.randrange(_MIN_ID, vocab) for _ in range(n_in - len(ids))]
        out.append(SimRequest(arrival, ids, n_out, int(rec.get("priority", 0))))
    if not out:
        raise ValueError(f"trace {path} has no requests")
    return sorted(out, key=lambda r: r.arrival)


def build_workload(args: argparse.Namespace, vocab: int, max_len: int) -> list[SimRequest]:
    """The requests of the workload ``args`` describe, sorted by arrival."""
    spec = args.workload or ("mixed" if args.mixed else "fixed")
    if spec not in ("fixed", "mixed", "sharegpt"):
        path = pathlib.Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"--workload {spec!r}: fixed, mixed, sharegpt or a JSONL trace file")
        return _trace(path, vocab, args.seed, max_len)
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if spec == "mixed" or (
        spec == "fixed" and args.input_dist == args.output_dist == "fixed" and not args.shared_prefix_len
    ):
        from pagedserve.entrypoints.cli.bench_throughput import make_workload  # the benchmark's own prompts

        pairs = make_workload(args.num_prompts, args.input_len, args.output_len, spec == "mixed", args.seed, vocab)
    else:
        rng = random.Random(args.seed)
        if spec == "sharegpt":
            sg = SHAREGPT
            cap = min(sg["max_len"], max_len - 1)
            lens = [
                (
                    _lengths(rng, "lognormal", sg["input_mean"], 0, sg["sigma"], cap),
                    _lengths(rng, "lognormal", sg["output_mean"], 0, sg["sigma"], cap),
                )
                for _ in range(args.num_prompts)
            ]
        else:
            lens = [
                (
                    _lengths(rng, args.input_dist, args.input_len, args.input_len_range, args.input_sigma, max_len - 1),
                    _lengths(
                        rng, args.output_dist, args.output_len, args.output_len_range, args.output_sigma, max_len - 1
                    ),
                )
                for _ in range(args.num_prompts)
            ]
        prefixes = (
            [
                [rng.randrange(_MIN_ID, vocab) for _ in range(args.shared_prefix_len)]
                for _ in range(max(1, args.num_prefixes))
            ]
            if args.shared_prefix_len
            else [[]]
        )
        pairs = []
        for i, (n_in, n_out) in enumerate(lens):
            pre = prefixes[i % len(prefixes)][: max(n_in - 1, 0)]
            pairs.append((pre + [rng.randrange(_MIN_ID, vocab) for _ in range(n_in - len(pre))], n_out))
    for ids, n_out in pairs:
        if len(ids) + n_out > max_len:
            raise ValueError(
                f"a request of {len(ids)} prompt + {n_out} output tokens exceeds max_model_len "
                f"{max_len}; lower the lengths or raise --max-model-len"
            )
    arrivals = arrival_times(len(pairs), args.request_rate, args.burstiness, args.seed)
    return [SimRequest(t, ids, n) for t, (ids, n) in zip(arrivals, pairs)]
