"""`EngineClient`: what the OpenAI server (and ``pagedserve serve``) use of the engine
they serve -- one `AsyncLLMEngine` or a `DataParallelRouter` over several engines.

The server tells the two apart by nothing but what this interface answers
(``supports_*``, ``replica_status()``, ``health()``), never by probing attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagedserve.async_engine import RequestStream
    from pagedserve.engine.stats import EngineStats
    from pagedserve.outputs import RequestOutput
    from pagedserve.pooling import PoolingParams
    from pagedserve.sampling_params import SamplingParams

__all__ = ["EngineCallbacks", "EngineClient"]


class EngineClient(Protocol):
    #: The error that stopped the engine(s), or None.
    fatal_error: BaseException | None

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def queue_capacity(self) -> int | None:
        """The most sequences the waiting queue(s) hold at once (``max_queue_len``, per
        replica under data parallelism); None where unbounded.  A request of more is
        refused whole (400) rather than as a full queue (503)."""
        ...

    @property
    def is_running(self) -> bool: ...

    @property
    def eos_token_ids(self) -> frozenset[int] | None:
        """The model's end-of-sequence ids (beam search); None where not served."""
        ...

    @property
    def classifier_labels(self) -> list[str] | None:
        """A sequence-classification model's label names; None for a causal LM."""
        ...

    @property
    def embedding_size(self) -> int:
        """The size of the model's embeddings (its hidden size)."""
        ...

    @property
    def lora_enabled(self) -> bool:
        """Whether requests may name LoRA adapters (enable_lora)."""
        ...

    def check_lora_adapter(self, path: str) -> None:
        """Load the adapter at ``path`` once (ValueError naming the problem)."""
        ...

    def generation_defaults(self) -> dict[str, Any]:
        """SamplingParams defaults from the model's generation_config.json."""
        ...

    def stats(self) -> EngineStats: ...

    def replica_status(self) -> list:
        """Per-replica state (data parallel); empty for one engine."""
        ...

    def health(self) -> tuple[int, dict | None]:
        """(HTTP status, JSON body or None) of GET /health."""
        ...

    def set_callbacks(
        self,
        on_request_output: Callable[[RequestOutput], None] | None = None,
        on_engine_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Callbacks run on the event loop: every output (metrics, logs); once, if the
        engine dies of an error (the server then stops).  None leaves one as it is."""
        ...

    def start(self) -> None: ...

    def shutdown(self, timeout: float | None = 30.0) -> None: ...

    def validate(
        self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None = None
    ) -> tuple[str | None, list[int]]: ...

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
        multi_modal_data: dict | None = None,
    ) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    # Sleep mode (enable_sleep_mode; one engine: refused with data parallelism).
    @property
    def is_sleeping(self) -> bool: ...

    async def sleep(self, level: int = 1) -> None:
        """Free the weights and KV cache (ValueError: not enabled, bad level, requests in flight)."""
        ...

    async def wake_up(self) -> None: ...


class EngineCallbacks:
    """The two callbacks every EngineClient keeps, and `set_callbacks` for them."""

    on_request_output: Callable[[RequestOutput], None] | None = None
    on_engine_dead: Callable[[BaseException], None] | None = None

    def set_callbacks(
        self,
        on_request_output: Callable[[RequestOutput], None] | None = None,
        on_engine_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """See `EngineClient.set_callbacks` (None leaves a callback as it is)."""
        if on_request_output is not None:
            self.on_request_output = on_request_output
        if on_engine_dead is not None:
            self.on_engine_dead = on_engine_dead
