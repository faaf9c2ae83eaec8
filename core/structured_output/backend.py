"""The xgrammar backend: the tokenizer's vocabulary as xgrammar sees it, grammars built
from StructuredOutputsParams (validation), compiled grammars and matchers.

Building a ``Grammar`` is tokenizer-independent and quick, so it runs when a request
arrives and turns a bad schema, regex or grammar into a ValueError naming it.
Compiling (the per-token work) is what the manager runs on its worker thread.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.structured_output.limits import GrammarLimits, check_limits, process_limits
from pagedserve.structured_params import BACKENDS, StructuredOutputsParams

__all__ = ["BACKENDS", "XgrammarBackend", "build_grammar"]


_COMPILER_CACHE_BYTES = 128 << 20


def _xgr():
    import xgrammar

    return xgrammar


def _choice_ebnf(choices: list[str]) -> str:
    # json.dumps gives a double-quoted, escaped literal, which is EBNF's string syntax too.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(
    params: StructuredOutputsParams, limits: GrammarLimits | None = None, max_whitespace: int = 20
) -> Any:
    """The xgrammar ``Grammar`` of ``params``; ValueError naming the field and the problem.

    ``limits`` (default: this process's engine limits) are checked first, on the text, so
    an oversized constraint never reaches xgrammar.  ``max_whitespace``: most whitespace
    characters in a row in JSON (-1: unbounded).
    """
    check_limits(params, limits or process_limits())
    xgr = _xgr()
    kind = params.kind
    ws = None if max_whitespace < 0 else max_whitespace
    try:
        if kind == "json":
            if params.disable_any_whitespace:
                return xgr.Grammar.from_json_schema(
                    params.json, any_whitespace=False, separators=(",", ":"), strict_mode=True
                )
            return xgr.Grammar.from_json_schema(params.json, strict_mode=True, max_whitespace_cnt=ws)
        if kind == "json_object":
            if params.disable_any_whitespace:
                return xgr.Grammar.from_json_schema(
                    {"type": "object"}, any_whitespace=False, separators=(",", ":"), strict_mode=False
                )
            if ws is not None:
                return xgr.Grammar.from_json_schema({"type": "object"}, strict_mode=False, max_whitespace_cnt=ws)
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        return _structural_tag(xgr, params.structural_tag)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / its own errors for bad specs
        raise ValueError(f"invalid structured_outputs.{kind}: {str(e).strip() or type(e).__name__}") from None


def _structural_tag(xgr, text: str) -> Any:
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ValueError(f"invalid structured_outputs.structural_tag: not JSON ({e})") from None
    if isinstance(spec, dict) and "structures" in spec:
        # vLLM's first format: {"type": "structural_tag", "structures": [{begin, schema, end}], "triggers": [...]}
        tags = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
            for s in spec["structures"]
        ]
        return xgr.Grammar.from_structural_tag(tags, list(spec.get("triggers", [])))
    return xgr.Grammar.from_structural_tag(spec)


class XgrammarBackend:
    """xgrammar set up for one tokenizer.

    Args:
        tokenizer: pagedserve's Tokenizer (a ``tokenizers`` backend inside).
        vocab_size: width of the model's logits, which may exceed the tokenizer's
            vocabulary (padding ids are never allowed).
        stop_token_ids: ids that end a grammar (the model's EOS ids).
    """

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1) -> None:
        xgr = _xgr()
        backend = tokenizer.backend
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for token, idx in vocab.items():
            if idx < vocab_size:
                encoded[idx] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded,
            vocab_type=meta["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=sorted(stop_token_ids) or None,
            add_prefix_space=meta["add_prefix_space"],
        )
        # One thread per compile leaves the other cores to the step loop; the compiler's
        # own cache is bounded (the manager keeps compiled grammars by key anyway).
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_limit_bytes=_COMPILER_CACHE_BYTES
        )
        #: int32 words per bitmask row.
        self.bitmask_width = (vocab_size + 31) // 32

    def compile(self, grammar: Any) -> Any:
        return self.compiler.compile_grammar(grammar)

    @staticmethod
    def matcher(compiled: Any) -> Any:
        # Rollback history is unlimited in xgrammar >= 0.1.25 (max_rollback_tokens is deprecated).
        return _xgr().GrammarMatcher(compiled)
