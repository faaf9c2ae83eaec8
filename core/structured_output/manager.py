"""Grammar compilation off the step loop, and each sequence's grammar state.

The engine owns one ``StructuredOutputManager``.  ``prepare`` validates a request's
constraint at once (ValueError for a bad one) and hands the compile to a worker
thread; compiled grammars are cached by the constraint's key, so a schema seen before
is ready at once.  Each sequence (every one of n samples) gets its own
``GrammarState``: the scheduler leaves it waiting until its grammar is compiled
(``ready``), the step's tail masks its logits with the bitmask its matcher fills
(``fill_bitmask``, gathered by pagedserve.structured_output.bitmask) and the engine
feeds it each accepted token (``accept``).

Preemption keeps the state consistent for free: a preempted sequence keeps its output
tokens, which the matcher has already accepted, and resumes by recomputing their KV.
Speculative decoding can undo tokens with ``rollback`` (xgrammar matchers keep
their whole history).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.structured_output.backend import BACKENDS, XgrammarBackend, build_grammar
from pagedserve.structured_output.limits import GrammarLimits
from pagedserve.structured_params import StructuredOutputsParams

__all__ = ["GrammarState", "StructuredOutputManager"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class GrammarState:
    """The grammar of one sequence.

    ``reasoning_end_ids``: when set, the constraint starts only after the model has
    emitted one of these tokens (the end of a ``<think>`` section).  ``stop_token_ids``:
    what a grammar that failed to compile allows, so that the sequence ends at once.
    ``timeout``: seconds the compile may take (0: no deadline), counted from the first
    ``ready()`` at which ``clock_started()`` is true (the vocabulary has been read for
    xgrammar); ``on_timeout`` is called once when it passes.
    """

    compiled: Future
    reasoning_end_ids: frozenset[int] | None = None
    stop_token_ids: tuple[int, ...] = ()
    timeout: float = 0.0
    clock_started: Any = None
    on_timeout: Any = None
    deadline: float | None = field(default=None, init=False)
    matcher: Any = field(default=None, init=False)
    failed: str | None = field(default=None, init=False)
    #: Tokens accepted by the matcher (output tokens after any reasoning section).
    num_accepted: int = field(default=0, init=False)

    def ready(self) -> bool:
        """Whether the grammar is compiled (or failed to); the scheduler waits until then."""
        if self.matcher is not None or self.failed is not None:
            return True
        if not self.compiled.done():
            now = time.monotonic()
            if self.deadline is None and self.timeout > 0 and (self.clock_started is None or self.clock_started()):
                self.deadline = now + self.timeout
            if self.deadline is None or now < self.deadline:
                return False
            # xgrammar cannot stop a compile: it finishes in the background (bounded by the
            # size limits) while this request fails now.
            self.failed = (
                f"structured_outputs: the constraint did not compile within grammar_compile_timeout="
                f"{self.timeout}s (--grammar-compile-timeout)"
            )
            if self.on_timeout is not None:
                self.on_timeout()
            return True
        try:
            self.matcher = XgrammarBackend.matcher(self.compiled.result())
        except Exception as e:  # a grammar that validated but did not compile: end the sequence
            self.failed = f"{type(e).__name__}: {e}"
            logger.error("structured output grammar failed to compile: %s", self.failed)
        return True

    @property
    def constraining(self) -> bool:
        """Whether the next token is constrained (past the reasoning section, not finished)."""
        return self.reasoning_end_ids is None and not self.is_terminated

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, stop_ids: list[int] | None = None) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit j%32 of
        word j//32); a failed grammar allows ``stop_ids`` (default: its own stop tokens)."""
        if self.matcher is None:  # failed: only the stop tokens, so the sequence ends now
            bitmask[row].zero_()
            for t in self.stop_token_ids if stop_ids is None else stop_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        if self.reasoning_end_ids is not None:
            if token in self.reasoning_end_ids:
                self.reasoning_end_ids = None  # the constraint starts with the next token
            return True
        if self.matcher is None or self.matcher.is_terminated():
            return True
        ok = bool(self.matcher.accept_token(token))
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        if num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {self.num_accepted} were accepted")
        if self.matcher is not None and num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens


def _digest(key: tuple[str, str]) -> tuple[str, str]:
    # Keys may be 64 KiB of schema; the refused ones are remembered by a digest.
    return key[0], hashlib.sha256(key[1].encode()).hexdigest()


def _bit(i: int) -> int:
    # Bit 31 of an int32 word is its sign bit.
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


class StructuredOutputManager:
    """Compiles grammars on a worker thread with a cache keyed by the constraint.

    Args:
        backend: "xgrammar" or "auto".
        tokenizer, vocab_size, stop_token_ids: see XgrammarBackend.
        reasoning_end_ids: token ids ending a reasoning section (``--reasoning-parser``);
            constraints then apply after it.
        cache_size: compiled grammars kept.
        limits: size bounds checked before a constraint is built (GrammarLimits).
        compile_timeout: seconds a compile may take (0: no deadline).
        max_whitespace: most whitespace characters in a row in JSON (-1: unbounded).
    """

    def __init__(
        self,
        backend: str,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        reasoning_end_ids: frozenset[int] | None = None,
        cache_size: int = 256,
        limits: GrammarLimits | None = None,
        compile_timeout: float = 10.0,
        max_whitespace: int = 20,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.reasoning_end_ids = reasoning_end_ids
        self.cache_size = cache_size
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self.limits = limits or GrammarLimits()
        self.compile_timeout = compile_timeout
        self.max_whitespace = max_whitespace
        #: Keys whose compile ran past the deadline: refused at once from then on.
        self._too_slow: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._key_of: weakref.WeakKeyDictionary[Future, tuple[str, str]] = weakref.WeakKeyDictionary()

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row (the logits' width / 32, rounded up)."""
        return (self.vocab_size + 31) // 32

    @property
    def backend(self) -> XgrammarBackend:
        # Built on first use, on the worker thread: reading the vocabulary takes a
        # second or two that neither startup nor the step loop should pay.
        with self._backend_lock:
            if self._backend is None:
                self._backend = XgrammarBackend(self._tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backend

    def prepare(self, params: StructuredOutputsParams) -> Future:
        """Validate ``params`` now (ValueError naming the problem) and compile in the background.

        Returns the future of the compiled grammar (shared by requests with the same key).
        """
        key = params.key()
        if _digest(key) in self._too_slow:
            raise ValueError(
                f"structured_outputs.{key[0]}: this constraint did not compile within "
                f"grammar_compile_timeout={self.compile_timeout}s (--grammar-compile-timeout)"
            )
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._cache.move_to_end(key)
            return fut
        grammar = build_grammar(params, self.limits, self.max_whitespace)
        if self._pool is None:
            # Two workers: a constraint that compiles slowly does not hold up the next one.
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedserve-grammar")
        fut = self._pool.submit(lambda: self.backend.compile(grammar))
        self._key_of[fut] = key
        self._cache[key] = fut
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return fut

    def new_state(self, compiled: Future) -> GrammarState:
        key = self._key_of.get(compiled)
        return GrammarState(
            compiled,
            self.reasoning_end_ids,
            tuple(self.stop_token_ids),
            timeout=self.compile_timeout,
            clock_started=lambda: self._backend is not None,
            on_timeout=lambda: self._timed_out(key),
        )

    def _timed_out(self, key: tuple[str, str] | None) -> None:
        if key is not None:
            self._too_slow[_digest(key)] = None
            while len(self._too_slow) > self.cache_size:
                self._too_slow.popitem(last=False)
            self._cache.pop(key, None)
        logger.warning("a %s constraint did not compile within %ss", key[0] if key else "", self.compile_timeout)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
