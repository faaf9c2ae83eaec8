"""Embeddings: pooling a prompt's final hidden states into one vector.

A pooling request is a prompt-only request: it runs through the scheduler like any
prefill (chunked prefill included), samples nothing, and finishes (freeing its KV
blocks) as soon as its last prompt chunk has run.  The hidden states pooled are the
last layer's output after the final norm.  Each step the runner reduces the rows of
every pooling request's chunk to a :class:`PooledPart` (``pool_spans`` picks the rows,
``pool_rows`` sums them where the final hidden states are); the engine
folds the parts of a request together (:class:`PoolingState`) and normalises at the end.

Pooling types (sentence-transformers' names in brackets):

- ``last`` (pooling_mode_lasttoken): the state of the last prompt token;
- ``mean`` (pooling_mode_mean_tokens): the mean over every prompt position;
- ``cls`` (pooling_mode_cls_token): the state of the first prompt token.

Classification (``PoolingParams(task="classify")``, sequence-classification checkpoints
such as ``LlamaForSequenceClassification``): the request pools ``last`` whatever the
engine's setting (transformers' semantics: the last token's final hidden state) and the
engine applies the checkpoint's ``score.weight`` ``[num_labels, hidden]`` to that float32
vector, so the head composes with tensor and pipeline parallelism as pooling does.  The
result's ``probs`` are sigmoid(logit) for one label (a cross-encoder's relevance, as
sentence-transformers' CrossEncoder and vLLM give it) and the softmax over several.

``mean`` and ``cls`` need the states of positions a prefix-cache hit would skip, so such
requests skip the prefix-cache lookup (as prompt_logprobs requests do); ``last`` always
computes its last position and may use the cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "POOLING_TYPES",
    "PoolingParams",
    "PooledPart",
    "PoolingState",
    "EmbeddingOutput",
    "ClassificationOutput",
    "EmbeddingRequestOutput",
    "PoolSpan",
    "pool_spans",
    "pool_rows",
    "pooled_parts",
    "pooling_from_checkpoint",
    "resolve_pooling",
    "load_score_head",
    "classifier_labels",
    "needs_every_position",
]

POOLING_TYPES = ("last", "mean", "cls")

#: sentence-transformers 1_Pooling/config.json keys -> our pooling types.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass
class PoolingParams:
    """Per-request pooling options (vLLM's name).

    normalize: L2-normalise the pooled vector (the default, as sentence-transformers'
    Normalize module and OpenAI's embeddings do).
    dimensions: must be None or the model's hidden size (no Matryoshka truncation).
    """

    normalize: bool = True
    dimensions: int | None = None
    #: "embed" (the pooled vector) or "classify" (the score head's logits, see above).
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.task not in ("embed", "classify"):
            raise ValueError(f"PoolingParams.task must be 'embed' or 'classify', got {self.task!r}")


@dataclass
class PooledPart:
    """One step's contribution of one request: a float32 sum of ``count`` hidden rows
    ``[hidden_size]`` (``mean``), or the one row pooled (``last``/``cls``, count 1)."""

    vector: torch.Tensor
    count: int
    #: Prompt position of the chunk's first row: 0 again means a recompute after preemption.
    start: int = 0


@dataclass
class PoolingState:
    """Engine-side accumulation of one request's :class:`PooledPart`s."""

    pooling: str
    total: torch.Tensor | None = None
    count: int = 0
    #: A classification request: the float32 score head ``[num_labels, hidden]``.
    head: torch.Tensor | None = None

    def add(self, part: PooledPart) -> None:
        if self.pooling == "mean" and self.total is not None and part.start > 0:
            self.total = self.total + part.vector
            self.count += part.count
        else:
            # The first chunk, or a recompute after preemption (which starts over at
            # position 0; the last/cls row comes out the same).
            self.total, self.count = part.vector, part.count

    def result(self, normalize: bool) -> list[float]:
        """The pooled vector ``[hidden_size]`` as floats, L2-normalised if asked."""
        if self.total is None:
            raise RuntimeError("no hidden states were pooled for this request")
        v = self.total / self.count if self.pooling == "mean" else self.total
        if self.head is not None:
            return (self.head @ v).tolist()
        if normalize:
            v = torch.nn.functional.normalize(v, p=2.0, dim=0)
        return v.tolist()


@dataclass
class EmbeddingOutput:
    """The embedding of one prompt (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """The score head's output for one prompt (vLLM's ``ClassificationOutput``)."""

    logits: list[float]

    @property
    def probs(self) -> list[float]:
        """sigmoid(logit) for one label, else the softmax over the labels."""
        t = torch.tensor(self.logits, dtype=torch.float64)
        return (torch.sigmoid(t) if len(self.logits) == 1 else torch.softmax(t, 0)).tolist()

    @property
    def num_classes(self) -> int:
        return len(self.logits)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's shape): ``outputs.embedding``."""

    request_id: str
    outputs: EmbeddingOutput | ClassificationOutput | None
    prompt_token_ids: list[int]
    prompt: str | None = None
    finished: bool = True
    #: Set when this request failed on its own; others go on.
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def needs_every_position(pooling: str | None) -> bool:
    """Whether a request pooled this way must compute every prompt position itself."""
    return pooling in ("mean", "cls")


@dataclass(frozen=True)
class PoolSpan:
    """The rows of a batch one pooling request reduces this step: plain data (it travels
    to the ranks holding the final hidden states).  ``num_rows`` rows from ``first`` are
    summed in float32; ``count`` and ``start`` are those of its :class:`PooledPart`."""

    request_id: str
    first: int
    num_rows: int
    count: int
    start: int


def pool_spans(scheduled) -> list[PoolSpan]:
    """What each pooling request (``request.pooling`` set) of a batch pools this step.

    scheduled: the batch's ScheduledRequests in order.  Only requests that pool something
    now are listed: every chunk for ``mean``, the last chunk for ``last``, the first for
    ``cls``."""
    spans = []
    start = 0
    for s in scheduled:
        r, n = s.request, s.num_new_tokens
        kind = getattr(r, "pooling", None)
        c = r.num_computed_tokens if kind is not None else 0
        if kind == "mean":
            spans.append(PoolSpan(r.request_id, start, n, n, c))
        elif kind == "last" and c + n >= r.num_prompt_tokens:
            spans.append(PoolSpan(r.request_id, start + n - 1, 1, 1, c))
        elif kind == "cls" and c == 0:
            spans.append(PoolSpan(r.request_id, start, 1, 1, c))
        start += n
    return spans


def pool_rows(hidden: torch.Tensor, spans: list[PoolSpan]) -> torch.Tensor:
    """hidden ``[num_tokens, hidden_size]`` (a batch's final-norm hidden states) -> float32
    ``[len(spans), hidden_size]``: each span's rows summed, on hidden's device."""
    if not spans:
        return hidden.new_empty(0, hidden.shape[1], dtype=torch.float32)
    return torch.stack([hidden[s.first : s.first + s.num_rows].float().sum(dim=0) for s in spans])


def pooled_parts(spans: list[PoolSpan], vectors: torch.Tensor) -> dict[str, PooledPart]:
    """The :class:`PooledPart` of each span (``vectors`` as :func:`pool_rows` returns
    them), by request id, on the host."""
    vectors = vectors.cpu()
    return {s.request_id: PooledPart(vectors[j], s.count, s.start) for j, s in enumerate(spans)}


def pooling_from_checkpoint(path: str | Path | None) -> str | None:
    """The pooling a sentence-transformers checkpoint folder declares (``modules.json``
    naming a Pooling module whose ``config.json`` sets one ``pooling_mode_*``), or None."""
    if path is None:
        return None
    root = Path(path)
    if not root.is_dir() or not (root / "modules.json").is_file():
        return None
    modules = json.loads((root / "modules.json").read_text())
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            cfg = json.loads((root / module.get("path", "1_Pooling") / "config.json").read_text())
            modes = [ours for key, ours in _ST_MODES.items() if cfg.get(key)]
            others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
            if others or len(modes) != 1:
                raise ValueError(
                    f"{root}: sentence-transformers pooling {others or modes} is not supported; "
                    f"one of {', '.join(_ST_MODES)} must be set"
                )
            return modes[0]
    return None


def resolve_pooling(setting: str | None, path: str | Path | None) -> str:
    """The engine's pooling type: the ``pooling`` setting, else the checkpoint's
    sentence-transformers config, else ``last`` (decoder models)."""
    if setting is not None:
        return setting
    return pooling_from_checkpoint(path) or "last"


def load_score_head(source, num_labels: int | None, hidden_size: int) -> torch.Tensor | None:
    """The float32 ``score.weight`` ``[num_labels, hidden_size]`` of a sequence-classification
    checkpoint (``num_labels`` set, see ArchConfig), else None; ValueError when such a
    checkpoint lacks it or stores another shape (a bias is not supported: transformers'
    heads have none)."""
    if num_labels is None:
        return None
    weight = source.tensor("score.weight")
    if weight is None or tuple(weight.shape) != (num_labels, hidden_size):
        got = "none" if weight is None else f"shape {tuple(weight.shape)}"
        raise ValueError(
            f"{source.path}: a sequence-classification checkpoint needs score.weight of shape "
            f"({num_labels}, {hidden_size}), found {got}"
        )
    if source.tensor("score.bias") is not None:
        raise ValueError(f"{source.path}: a score.bias is not supported (transformers' heads have none)")
    return weight.float()


def classifier_labels(arch) -> list[str] | None:
    """The label names of a sequence-classification model (config.json ``id2label``,
    else ``LABEL_<i>`` as transformers names them), or None for a causal LM."""
    if arch.num_labels is None:
        return None
    names = arch.hf_config.get("id2label") or {}
    return [str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(arch.num_labels)]
