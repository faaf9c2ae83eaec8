"""The Python around the ops of a decode step, measured with the native kernels stubbed out.

    python benchmarks/decode_glue.py [MODEL] [--dtype auto] [--batch 1]

Loads MODEL (default: the default GGUF model) on one thread, runs a few decode steps of
``--batch`` requests, then replaces every kernel of the compiled CPU modules that a decode
step calls (the GGUF and packed bf16 linears, norms, rotary, cache write, attention, the
call that fuses those three, argmax, embedding) with a stub that returns a preallocated
output of the right shape, and
times with the minimum of many short repeats:

    layer   one decoder layer's ``layer_forward`` (layer 5, real tensors of that step)
    step    one whole engine step (scheduler, inputs, every layer, head, sampling, outputs)

What is left is the cost of the Python, the tensor allocations and views and the pybind
calls themselves: the "glue" a decode step pays on top of its kernels.  Minimum-of-repeats
timing of calls this short is little disturbed by other work on a shared machine, so two
trees can be compared here where end-to-end figures drown in noise (run it with each
tree's interpreter, alternating).  The stubs make the outputs meaningless: the process
exits after timing.

``--steps N`` first times N real decode steps of the same requests (before the stubs):
the median CPU seconds of the calling thread per step (with one thread, the step's whole
work) and the median wall time, the end-to-end figure to set beside the glue.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import timeit

import torch

#: Layer whose forward is timed (any middle layer: they are all alike).
LAYER = 5


def _stubs():
    bufs: dict = {}

    def buf(shape, dtype):
        key = (tuple(shape), dtype)
        if key not in bufs:
            bufs[key] = torch.randn(shape).to(dtype)
        return bufs[key]

    def gguf(x, data, type_id, bias, f32):
        n = data.shape[0] * 16 if data.dim() == 3 else data.shape[0]
        return buf((x.shape[0], n), torch.float32 if f32 else x.dtype)

    def gguf_silu(x, data, type_id, bias):
        n = data.shape[0] * 16 if data.dim() == 3 else data.shape[0]
        return buf((x.shape[0], n // 2), x.dtype)

    def none(*a, **k):
        return None

    return {
        "gguf_linear_out": gguf,
        "gguf_linear_silu_out": gguf_silu,
        "packed_linear": lambda x, w, bias, isa: buf((x.shape[0], w.shape[0] * 16), x.dtype),
        "packed_linear_silu_and_mul": lambda x, w, bias, isa: buf((x.shape[0], w.shape[0] * 8), x.dtype),
        "fused_add_rms_norm_f32res": none,
        "fused_add_rms_norm": none,
        "rotary_embedding": none,
        "reshape_and_cache": none,
        "paged_attention": none,
        "rotary_paged_attention": none,
        "rms_norm": lambda x, w, eps, isa: buf(tuple(x.shape), x.dtype),
        # A plain token (not a special one), so that detokenization advances as usual.
        "argmax": lambda x, isa: buf((x.shape[0],), torch.int64).fill_(1234),
        "embedding": lambda ids, w: buf((ids.shape[0], w.shape[1]), w.dtype),
    }


def best_us(fn, number: int, repeat: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--passes", type=int, default=3, help="figures printed per measure")
    p.add_argument("--steps", type=int, default=0, help="also time this many real decode steps first")
    args = p.parse_args()
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        threads=1,
        max_model_len=2048,
        kv_cache_memory="1GiB",
        seed=0,
        enable_prefix_caching=False,
    )
    eng = llm.llm_engine
    model = eng.runner.model
    captured: dict = {}
    forward = model.layer_forward

    def capture(ops, placement, index, layer, kv, x, residual, meta):
        if index == LAYER and x.shape[0] == args.batch and "args" not in captured:
            captured["args"] = (ops, placement, index, layer, kv, x.clone(), residual.clone(), meta)
        return forward(ops, placement, index, layer, kv, x, residual, meta)

    model.layer_forward = capture
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(args.prompt_len)], params)
    for _ in range(6):
        eng.step()
    model.layer_forward = forward
    if args.steps:
        cpu, wall = [], []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            eng.step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        print(
            f"real decode step (batch {args.batch}, {args.dtype}, {args.steps} steps): median "
            f"{statistics.median(cpu) * 1e3:.3f} ms CPU, {statistics.median(wall) * 1e3:.3f} ms wall"
        )
    stubs = _stubs()
    for name, mod in list(sys.modules.items()):
        if name.startswith(("pagedserve_quant_", "pagedserve_cpu_")):
            for op, fn in stubs.items():
                if hasattr(mod, op):
                    setattr(mod, op, fn)
    layer_args = captured["args"]

    def layer():
        return model.layer_forward(*layer_args)

    with torch.inference_mode():
        lay = [best_us(layer, 50, 200) for _ in range(args.passes)]
        step = [best_us(eng.step, 2, 100) for _ in range(args.passes)]
    lay_us, step_us = ", ".join(f"{v:.1f}" for v in lay), ", ".join(f"{v:.0f}" for v in step)
    print(f"glue of one decoder layer (batch {args.batch}, {args.dtype}): {lay_us} us")
    print(f"glue of one engine step: {step_us} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
