"""POST /v1/score (and /score) and /v1/rerank (and /rerank, /v2/rerank) in vLLM's
request and response shapes (Jina's and Cohere's rerank API): relevance scores from a
sequence-classification checkpoint's one-label head on the pair, or from the served
decoder answering "yes" or "no" (pagedserve.entrypoints.scoring); and POST /classify
(and /v1/classify) for sequence-classification checkpoints.

    /v1/score   {"model", "text_1": str | [str], "text_2": str | [str]}
             -> {"id", "object": "list", "created", "model",
                 "data": [{"index", "object": "score", "score"}], "usage"}
    /v1/rerank  {"model", "query", "documents": [str | {"text"}], "top_n", "return_documents"}
             -> {"id", "model", "usage": {"total_tokens"},
                 "results": [{"index", "document": {"text"}, "relevance_score"}]}  (best first)

    /classify   {"model", "input": str | [str] | [int] | [[int]]}
             -> {"id", "object": "list", "created", "model",
                 "data": [{"index", "label", "probs", "num_classes"}], "usage"}

Score and rerank take ``instruction`` (the yes/no reranker's task line; refused for a
classification head) and ``priority``; all three refuse any other field with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.protocol import normalize_prompts, parse_request
from pagedserve.entrypoints.openai.serving_base import OpenAIServing
from pagedserve.entrypoints.scoring import (
    answer_logprob,
    answer_params,
    answer_token_ids,
    check_score_labels,
    pair_texts,
    pair_token_ids,
    relevance,
    rerank_prompt,
)
from pagedserve.pooling import PoolingParams
from pagedserve.sampling_params import SamplingParams

__all__ = ["ScoreRequest", "RerankRequest", "ClassifyRequest", "OpenAIServingScore", "add_score_routes"]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    instruction: str | None = None
    priority: int = 0

    def refuse_extra(self) -> None:
        for name in self.model_extra or {}:
            raise ApiError(400, f"'{name}' is not supported by this server's scoring routes.", param=name)


class ScoreRequest(_Base):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Base):
    query: str
    documents: list[Any]
    top_n: int | None = None
    return_documents: bool = True


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: Any = None
    priority: int = 0


class OpenAIServingScore(OpenAIServing):
    async def _classify(
        self, prompts: list[tuple[str | None, list[int]]], field: str, priority: int, prefix: str
    ) -> tuple[str, list]:
        """(request id, the ClassificationOutput of each prompt)."""
        request_id = self.new_id(prefix)
        params = [SamplingParams(max_tokens=1)] * len(prompts)
        extra = {"pooling_params": PoolingParams(task="classify")}
        outs = await self.collect(await self.submit(request_id, prompts, params, field, priority, extra=extra))
        return request_id, [o.outputs for o in outs]

    async def _scores(self, pairs: list[tuple[str, str]], request: _Base, prefix: str) -> tuple[str, list[float], int]:
        """(request id, one score per pair, prompt tokens)."""
        field = "text_2" if prefix == "score" else "documents"
        labels = self.engine.classifier_labels
        if labels is not None:
            try:
                check_score_labels(labels)
            except ValueError as e:
                raise ApiError(400, str(e), param="model") from None
            if request.instruction is not None:
                raise ApiError(
                    400,
                    "'instruction' applies to yes/no rerankers, not to this classification model.",
                    param="instruction",
                )
            prompts = []
            for query, text in pairs:
                ids = pair_token_ids(self.tokenizer, query, text)
                prompts.append(self.validate_prompt(ids, field, ids))
            request_id, outs = await self._classify(prompts, field, request.priority, prefix)
            return request_id, [o.probs[0] for o in outs], sum(len(ids) for _, ids in prompts)
        try:
            yes, no = answer_token_ids(self.tokenizer)
        except ValueError as e:
            raise ApiError(400, str(e), param="model") from None
        prompts = []
        for query, text in pairs:
            prompt = rerank_prompt(query, text, request.instruction)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            prompts.append(self.validate_prompt(prompt, "text_2" if prefix == "score" else "documents", ids))
        request_id = self.new_id(prefix)
        both = [p for p in prompts for _ in (yes, no)]
        params = [answer_params(t) for _ in prompts for t in (yes, no)]
        outs = await self.collect(await self.submit(request_id, both, params, field, request.priority))
        scores = [
            relevance(answer_logprob(outs[2 * i], yes), answer_logprob(outs[2 * i + 1], no))
            for i in range(len(prompts))
        ]
        return request_id, scores, sum(len(ids) for _, ids in prompts)

    async def score(self, request: ScoreRequest) -> dict:
        request.refuse_extra()
        model = self.model_name(request.model)
        try:
            pairs = pair_texts(request.text_1, request.text_2, ("text_1", "text_2"))
        except ValueError as e:
            raise ApiError(400, str(e), param="text_1") from None
        request_id, scores, tokens = await self._scores(pairs, request, "score")
        return {
            "id": request_id,
            "object": "list",
            "created": self.created(),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    async def rerank(self, request: RerankRequest) -> dict:
        request.refuse_extra()
        model = self.model_name(request.model)
        if not request.documents:
            raise ApiError(400, "'documents' must not be empty.", param="documents")
        texts = []
        for i, d in enumerate(request.documents):
            text = d.get("text") if isinstance(d, dict) else d
            if not isinstance(text, str):
                raise ApiError(400, f"'documents[{i}]' must be a string or {{\"text\": ...}}.", param=f"documents[{i}]")
            texts.append(text)
        if request.top_n is not None and request.top_n < 1:
            raise ApiError(400, f"'top_n' must be at least 1, got {request.top_n}.", param="top_n")
        request_id, scores, tokens = await self._scores([(request.query, t) for t in texts], request, "rerank")
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[: request.top_n or len(texts)]
        results = []
        for i in order:
            item: dict = {"index": i, "relevance_score": scores[i]}
            if request.return_documents:
                item["document"] = {"text": texts[i]}
            results.append(item)
        return {"id": request_id, "model": model, "usage": {"total_tokens": tokens}, "results": results}

    async def classify(self, request: ClassifyRequest) -> dict:
        for name in request.model_extra or {}:
            raise ApiError(400, f"'{name}' is not supported by this server's classify route.", param=name)
        model = self.model_name(request.model)
        labels = self.engine.classifier_labels
        if labels is None:
            raise ApiError(
                400,
                "classification needs a sequence-classification checkpoint (a *ForSequenceClassification "
                "architecture with a score.weight head); this model has none.",
                param="model",
            )
        if request.input is None:
            raise ApiError(400, "Missing required parameter: 'input'.", param="input")
        try:
            inputs = normalize_prompts(request.input)
        except ApiError:
            raise ApiError(
                400,
                "'input' must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists, none of them empty.",
                param="input",
            ) from None
        prompts = []
        for p in inputs:
            ids = self.tokenizer.encode(p) if isinstance(p, str) else None
            prompts.append(self.validate_prompt(p, "input", ids))
        request_id, outs = await self._classify(prompts, "input", request.priority, "classify")
        data = []
        for i, o in enumerate(outs):
            probs = o.probs
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": labels[best], "probs": probs, "num_classes": o.num_classes})
        tokens = sum(len(ids) for _, ids in prompts)
        return {
            "id": request_id,
            "object": "list",
            "created": self.created(),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }


def add_score_routes(app: FastAPI, serving: OpenAIServingScore, read_body, respond) -> None:
    """Register the score and rerank routes; ``respond(request, work)`` runs the work under
    the server's disconnect and shutdown handling."""

    async def score(request: Request) -> Response:
        body = parse_request(ScoreRequest, await read_body(request))
        return await respond(request, serving.score(body))

    async def rerank(request: Request) -> Response:
        body = parse_request(RerankRequest, await read_body(request))
        return await respond(request, serving.rerank(body))

    async def classify(request: Request) -> Response:
        body = parse_request(ClassifyRequest, await read_body(request))
        return await respond(request, serving.classify(body))

    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])
    for path in ("/classify", "/v1/classify"):
        app.add_api_route(path, classify, methods=["POST"])
