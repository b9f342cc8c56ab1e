"""Request bodies of the OpenAI API, as pydantic models.

Field names are OpenAI's. Extension fields (not in OpenAI's API) carry the
speculative settings:
    k        draft tokens per step (0: target-only decoding); server default when absent
    drafter  which drafter proposes ("ngram", "model", ...); server default when absent
    top_k    sample from the k most likely tokens (0 disables), the name vLLM and TGI use
The openai SDK sends them with `extra_body={"k": 4, "drafter": "ngram", "top_k": 50}`.

Unknown fields are ignored, as OpenAI-compatible servers do (clients and
frameworks send fields of newer API versions); known fields we cannot honour
(n > 1, logprobs, tools, penalties, ...) are rejected by `unsupported()`, so a
client never silently gets something other than what it asked for.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NonNegativeInt = Annotated[int, Field(ge=0)]
# The proto's int32 fields (token ids, k, top_k, max_new_tokens) hold at most this.
INT32_MAX = 2 ** 31 - 1
# Token ids travel as int32 on the wire; the orchestrator checks them against the vocabulary.
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # "developer" is what newer OpenAI models call the system role; "tool"/"function" are refused later.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Common(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)   # OpenAI's range
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # OpenAI's seed is a signed 64-bit integer; ours is unsigned: negative seeds wrap (see translate).
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    # Accepted and recorded in the logs; it becomes the tenant once tenants exist.
    user: str | None = None
    # Known OpenAI fields we do not implement: accepted at their neutral value, refused otherwise.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    # Extensions (see the module docstring).
    k: NonNegativeInt | None = None
    drafter: str | None = None
    top_k: NonNegativeInt | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    # A string, or token ids of the target's tokenizer; a batch of one is unwrapped.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


def unsupported(req: _Common) -> tuple[str, str] | None:
    """(field, why) for the first field asking for something we cannot do; None when all is fine."""
    if req.n not in (None, 1):
        return "n", f"only n = 1 is supported, got {req.n}; send separate requests (with different seeds)"
    if req.presence_penalty:
        return "presence_penalty", "penalties are not supported (speculative decoding samples the target exactly)"
    if req.frequency_penalty:
        return "frequency_penalty", "penalties are not supported (speculative decoding samples the target exactly)"
    if req.logit_bias:
        return "logit_bias", "logit_bias is not supported"
    if req.logprobs not in (None, False, 0):
        return "logprobs", "logprobs are not supported"
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs:
            return "top_logprobs", "logprobs are not supported"
        if req.tools:
            return "tools", "tool calling is not supported"
        if req.functions:
            return "functions", "function calling is not supported"
        if req.response_format and req.response_format.get("type", "text") != "text":
            return "response_format", "only the text response format is supported"
    if isinstance(req, CompletionRequest):
        if req.echo:
            return "echo", "echo is not supported"
        if req.suffix:
            return "suffix", "suffix is not supported"
        if req.best_of not in (None, 1):
            return "best_of", f"only best_of = 1 is supported, got {req.best_of}"
    if not req.stream and req.stream_options is not None:
        return "stream_options", "stream_options is only allowed with stream = true"
    return None
