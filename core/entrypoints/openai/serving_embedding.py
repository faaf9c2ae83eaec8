"""POST /v1/embeddings: OpenAI's embeddings API (vLLM's ``EmbeddingCompletionRequest``).

    {"model", "input": str | [str] | [int] | [[int]], "encoding_format": "float" | "base64",
     "dimensions", "user"}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage": {"prompt_tokens", "total_tokens"}}

Each input is one engine request pooled as the engine's ``pooling`` setting says (see
pagedserve.pooling).  ``base64`` is the little-endian float32 bytes of the vector, as
OpenAI's clients decode it.  Fields of vLLM's request that this server does not
implement are refused with a 400 when set (request_fields' field-walk).
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from pagedserve.entrypoints.openai.errors import ApiError
from pagedserve.entrypoints.openai.protocol import normalize_prompts, parse_request
from pagedserve.entrypoints.openai.request_fields import HONOURED, REFUSED, Field, refuse_unimplemented
from pagedserve.entrypoints.openai.serving_base import OpenAIServing
from pagedserve.entrypoints.openai.serving_fields import response_id
from pagedserve.pooling import PoolingParams
from pagedserve.sampling_params import SamplingParams

__all__ = ["EmbeddingRequest", "EMBEDDING_FIELDS", "OpenAIServingEmbedding", "add_embedding_route", "encode_embedding"]

#: Every field of vLLM's embeddings request and what this server does with it.
EMBEDDING_FIELDS: dict[str, Field] = {
    "model": Field(HONOURED, None, "a served model name (404 otherwise)"),
    "input": Field(HONOURED, None, "a string, strings, token ids or lists of token ids"),
    "encoding_format": Field(HONOURED, "float", "float (a list of numbers) or base64 (little-endian float32)"),
    "dimensions": Field(HONOURED, None, "must equal the model's hidden size (no truncation)"),
    "user": Field(HONOURED, None, "end-user id for the operator's logs; no effect on the output"),
    "add_special_tokens": Field(HONOURED, True, "add the tokenizer's BOS/EOS to a text input"),
    "priority": Field(HONOURED, 0, "lower is served first under --scheduling-policy priority"),
    "request_id": Field(HONOURED, None, "used in the response id"),
    "normalize": Field(HONOURED, None, "L2-normalise the embedding (default true)"),
    "truncate_prompt_tokens": Field(REFUSED, None, "keep only the last k input tokens"),
    "additional_data": Field(REFUSED, None, "opaque data for custom extensions"),
    "mm_processor_kwargs": Field(REFUSED, None, "multimodal processor arguments"),
    "cache_salt": Field(REFUSED, None, "salts the prefix-cache hashes"),
    "embed_dtype": Field(REFUSED, "float32", "base64 element type other than float32"),
    "endianness": Field(REFUSED, "native", "base64 byte order other than OpenAI's little-endian"),
    "messages": Field(REFUSED, None, "chat-formatted embedding input"),
    "softmax": Field(REFUSED, None, "softmax over the pooled output"),
    "activation": Field(REFUSED, None, "activation over the pooled output"),
    "use_activation": Field(REFUSED, None, "activation over the pooled output"),
}


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's fields, then vLLM's)."""

    # Extra fields are kept so that vLLM fields not implemented here can be refused.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: Any = None  # str | list[str] | list[int] | list[list[int]], checked by normalize_prompts
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    normalize: bool | None = None


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The ``embedding`` value of one item: the floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, request: EmbeddingRequest) -> dict:
        refuse_unimplemented(request, EMBEDDING_FIELDS)
        model = self.model_name(request.model)
        hidden = self.engine.embedding_size
        if request.dimensions is not None and request.dimensions != hidden:
            raise ApiError(
                400,
                f"'dimensions' = {request.dimensions} is not supported: this model's embeddings "
                f"have {hidden} dimensions (no truncation).",
                param="dimensions",
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
            ids = (
                self.tokenizer.encode(p, add_special_tokens=request.add_special_tokens) if isinstance(p, str) else None
            )
            prompts.append(self.validate_prompt(p, "input", prompt_token_ids=ids))
        pooling = PoolingParams(normalize=request.normalize is not False, dimensions=request.dimensions)
        params = [SamplingParams(max_tokens=1)] * len(prompts)
        request_id = response_id("embd", request, self.new_id("embd"))
        streams = await self.submit(
            request_id, prompts, params, "input", request.priority, extra={"pooling_params": pooling}
        )
        finals = await self.collect(streams)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": encode_embedding(out.outputs.embedding, request.encoding_format),
            }
            for i, out in enumerate(finals)
        ]
        tokens = sum(len(out.prompt_token_ids) for out in finals)
        return {
            "id": request_id,
            "object": "list",
            "created": self.created(),
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def add_embedding_route(app: FastAPI, serving: OpenAIServingEmbedding, read_body, respond) -> None:
    """Register POST /v1/embeddings; ``respond(request, work)`` runs the work under the
    server's disconnect and shutdown handling."""

    @app.post("/v1/embeddings")
    async def create_embedding(request: Request) -> Response:
        body = parse_request(EmbeddingRequest, await read_body(request))
        return await respond(request, serving.create(body))
