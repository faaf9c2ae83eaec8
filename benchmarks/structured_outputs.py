"""Structured outputs on the default model: decode speed with and without a JSON-schema
constraint, grammar compile time, and the fraction of valid outputs.

    python benchmarks/structured_outputs.py [--threads 2] [--max-tokens 64] [--samples 4]

1. tokens/s at batch 1 and 16: the same chat requests, constrained by a schema that
   cannot finish within --max-tokens (a long required string) and unconstrained with
   ignore_eos, so both generate exactly --max-tokens tokens per request.
2. compile time of a 20-field schema: cold (a fresh compiler) and cached (same schema again).
3. a battery of schemas sampled at temperature 0.8: every output that finished (stop)
   must parse and validate (jsonschema); outputs cut by max_tokens are counted apart.
"""

from __future__ import annotations

import argparse
import json
import time

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
BATTERY = [
    PERSON,
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "temp_c": {"type": "number", "minimum": -50, "maximum": 60},
            "sky": {"enum": ["clear", "cloudy", "rain"]},
        },
        "required": ["city", "temp_c", "sky"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 5},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"]}},
        "required": ["ok", "note"],
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["id", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "email": {"type": "string", "format": "email"},
                },
                "required": ["name", "email"],
            },
            "score": {"type": "integer"},
        },
        "required": ["user", "score"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
    {
        "anyOf": [
            {"type": "object", "properties": {"yes": {"const": True}}, "required": ["yes"]},
            {"type": "object", "properties": {"no": {"type": "string", "maxLength": 12}}, "required": ["no"]},
        ]
    },
]


def twenty_fields() -> dict:
    kinds = [
        {"type": "string", "maxLength": 30},
        {"type": "integer", "minimum": 0},
        {"type": "boolean"},
        {"type": "number"},
        {"enum": ["a", "b", "c"]},
    ]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props)}


def decode_speed(llm, batch: int, max_tokens: int, repeats: int = 1) -> dict:
    from pagedserve import SamplingParams, StructuredOutputsParams

    endless = {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 100000}},
        "required": ["story"],
    }
    ask = [[{"role": "user", "content": f"Write story number {i} as JSON."}] for i in range(batch)]
    out = {"unconstrained": 0.0, "json_schema": 0.0}
    # Alternating runs, best of --repeats each: on a shared machine the best run is the
    # one least disturbed by other work.
    for _ in range(repeats):
        for name, so in (("unconstrained", None), ("json_schema", StructuredOutputsParams(json=endless))):
            params = SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=so is None, structured_outputs=so
            )
            llm.chat(ask[:1], SamplingParams(max_tokens=2, structured_outputs=so), use_tqdm=False)  # warm up
            t = time.perf_counter()
            res = llm.chat(ask, params, use_tqdm=False)
            dt = time.perf_counter() - t
            tokens = sum(len(o.token_ids) for r in res for o in r.outputs)
            assert tokens == batch * max_tokens, tokens
            out[name] = max(out[name], tokens / dt)
    out["slowdown"] = 1 - out["json_schema"] / out["unconstrained"]
    return out


def mask_overhead(llm, batch: int, max_tokens: int) -> dict:
    """Time inside the constraint's own work (bitmask fill + apply, matcher advance) as a
    share of the constrained run: a ratio that other load on the machine affects less
    than two separate wall-clock runs."""
    import pagedserve.engine.output_processor as engine_mod
    from pagedserve import SamplingParams, StructuredOutputsParams

    mgr = llm.llm_engine.structured
    spent = {"mask": 0.0, "advance": 0.0}
    apply, finish = mgr.apply, engine_mod.finish_by_grammar

    def timed_apply(*a, **k):
        t = time.perf_counter()
        try:
            return apply(*a, **k)
        finally:
            spent["mask"] += time.perf_counter() - t

    def timed_finish(*a, **k):
        t = time.perf_counter()
        try:
            return finish(*a, **k)
        finally:
            spent["advance"] += time.perf_counter() - t

    endless = {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 100000}},
        "required": ["story"],
    }
    ask = [[{"role": "user", "content": f"Write story number {i} as JSON."}] for i in range(batch)]
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputsParams(json=endless)
    )
    llm.chat(ask[:1], params, use_tqdm=False)  # compile
    mgr.apply, engine_mod.finish_by_grammar = timed_apply, timed_finish
    try:
        t = time.perf_counter()
        llm.chat(ask, params, use_tqdm=False)
        total = time.perf_counter() - t
    finally:
        mgr.apply, engine_mod.finish_by_grammar = apply, finish
    return {
        "batch": batch,
        "total_s": total,
        "mask_s": spent["mask"],
        "advance_s": spent["advance"],
        "share": (spent["mask"] + spent["advance"]) / total,
    }


def compile_times(llm) -> dict:
    from pagedserve import StructuredOutputsParams
    from pagedserve.structured_output import StructuredOutputManager

    eng = llm.llm_engine
    mgr = StructuredOutputManager("xgrammar", eng.tokenizer, eng.arch.vocab_size, sorted(eng.eos_token_ids))
    _ = mgr.backend  # the tokenizer info is built once per engine, not per grammar
    schema = twenty_fields()
    t = time.perf_counter()
    mgr.prepare(StructuredOutputsParams(json=schema)).result()
    cold = time.perf_counter() - t
    t = time.perf_counter()
    mgr.prepare(StructuredOutputsParams(json=json.dumps(schema))).result()
    cached = time.perf_counter() - t
    mgr.shutdown()
    return {"cold_ms": cold * 1e3, "cached_ms": cached * 1e3}


def validity(llm, samples: int) -> dict:
    import jsonschema

    from pagedserve import SamplingParams, StructuredOutputsParams

    valid = stopped = cut = 0
    failures = []
    for i, schema in enumerate(BATTERY):
        ask = [{"role": "user", "content": "Answer with JSON only."}]
        params = SamplingParams(
            n=samples, max_tokens=200, temperature=0.8, seed=i, structured_outputs=StructuredOutputsParams(json=schema)
        )
        for o in llm.chat(ask, params, use_tqdm=False)[0].outputs:
            if o.finish_reason != "stop":
                cut += 1
                continue
            stopped += 1
            try:
                jsonschema.validate(json.loads(o.text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append((i, o.text, str(e)[:200]))
    return {
        "finished": stopped,
        "valid": valid,
        "fraction_valid": valid / max(stopped, 1),
        "cut_by_max_tokens": cut,
        "failures": failures,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--samples", type=int, default=4, help="samples per battery schema")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--repeats", type=int, default=3, help="alternating timed runs per setting (best counts)")
    p.add_argument("--only", choices=["speed", "overhead", "compile", "validity"], default=None)
    args = p.parse_args()
    from pagedserve import LLM

    llm = LLM(max_model_len=1024, kv_cache_memory="256MiB", threads=args.threads)
    result = {}
    if args.only in (None, "speed"):
        result["decode_tokens_per_s"] = {
            b: decode_speed(llm, int(b), args.max_tokens, args.repeats) for b in args.batches.split(",")
        }
    if args.only in (None, "overhead"):
        result["constraint_overhead"] = [mask_overhead(llm, int(b), args.max_tokens) for b in args.batches.split(",")]
    if args.only in (None, "compile"):
        result["compile_20_fields"] = compile_times(llm)
    if args.only in (None, "validity"):
        result["validity"] = validity(llm, args.samples)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
