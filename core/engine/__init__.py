"""The engine: request intake, the step loop and output processing.

- `llm_engine`: `LLMEngine`, the composition and the step;
- `input_processor`: validation, the samples of a request, embedding intake;
- `output_processor`: request state, detokenization, stop strings, logprobs, outputs;
- `async_pipeline`: async_scheduling, outputs made beside the next forward;
- `step_hooks`: features that take part in each step (speculative decoding, the trace);
- `kv_handoff`: prefix KV out of and into an engine (disaggregated prefill/decode);
- `stats`: `EngineStats` and the counters behind it;
- `client`: `EngineClient`, what the OpenAI server uses of the engine it serves;
- `request_options`: per-request checks, the n / best_of samples, prompt truncation;
- `step_trace`: the PAGEDSERVE_STEP_TRACE writer.
"""

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats

__all__ = ["LLMEngine", "EngineStats", "ITERATION_TOKEN_BUCKETS"]
