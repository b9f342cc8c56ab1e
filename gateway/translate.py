"""OpenAI request bodies -> GenerateRequest, and GenerateChunk / stats -> OpenAI
response bodies. Pure functions: no I/O, so each is unit-tested on its own."""
from __future__ import annotations

from dataclasses import dataclass, field

from gateway.errors import APIError, invalid
from gateway.schemas import INT32_MAX, ChatCompletionRequest, ChatMessage, CompletionRequest, unsupported
from specmesh.v1 import orchestrator_pb2, sampling_pb2

# OpenAI's default temperature; a request that leaves it out samples, as it would at OpenAI.
DEFAULT_TEMPERATURE = 1.0
# A model id "<target>:<drafter>" picks the drafter, for clients that can set only the model.
DRAFTER_SEPARATOR = ":"
# OpenAI's finish reasons are stop and length; a session ended by Cancel says so.
_FINISH = {"stop": "stop", "length": "length", "cancelled": "cancelled"}


@dataclass(frozen=True)
class Served:
    """What /v1/models lists, from the orchestrator's ListModels."""

    model: str                                  # the id clients send: the target (or --served-model-name)
    target_model: str                           # the verifier's model
    drafters: dict[str, str] = field(default_factory=dict)   # drafter name -> draft model ("" model-free)
    default_drafter: str = ""
    max_context: int = 0
    default_k: int = 0
    max_k: int = 0

    @classmethod
    def from_pb(cls, reply: orchestrator_pb2.ListModelsResponse, served_name: str = "") -> "Served":
        return cls(model=served_name or reply.target_model, target_model=reply.target_model,
                   drafters={d.name: d.model for d in reply.drafters}, default_drafter=reply.default_drafter,
                   max_context=reply.max_context, default_k=reply.default_k, max_k=reply.max_k)

    def model_ids(self) -> list[str]:
        return [self.model] + [f"{self.model}{DRAFTER_SEPARATOR}{name}" for name in sorted(self.drafters)]

    def resolve(self, model: str) -> str:
        """The drafter a model id asks for ("" for the default); 404 for an id we do not serve."""
        if model == self.model:
            return ""
        base, sep, drafter = model.rpartition(DRAFTER_SEPARATOR)
        if sep and base == self.model and drafter in self.drafters:
            return drafter
        raise APIError(404, f"The model '{model}' does not exist; this server serves {', '.join(self.model_ids())}",
                       "invalid_request_error", "model", "model_not_found")

    def models_list(self, created: int) -> dict:
        """GET /v1/models: the target, then one entry per drafter it can be paired with."""
        data = [{"id": self.model, "object": "model", "created": created, "owned_by": "specmesh",
                 "root": self.target_model, "parent": None, "max_model_len": self.max_context,
                 "specmesh": {"role": "target", "default_drafter": self.default_drafter,
                              "default_k": self.default_k, "max_k": self.max_k}}]
        for name in sorted(self.drafters):
            data.append({"id": f"{self.model}{DRAFTER_SEPARATOR}{name}", "object": "model", "created": created,
                         "owned_by": "specmesh", "root": self.target_model, "parent": self.model,
                         "max_model_len": self.max_context,
                         "specmesh": {"role": "drafter", "drafter": name, "draft_model": self.drafters[name] or None}})
        return {"object": "list", "data": data}


def _content(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise invalid(f"messages[{index}].content[{j}].type", f"only text content is supported, got {part.type!r}")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(messages: list[ChatMessage]) -> list[orchestrator_pb2.ChatMessage]:
    out = []
    for i, m in enumerate(messages):
        if m.role in ("tool", "function"):
            raise invalid(f"messages[{i}].role", f"role {m.role!r} is not supported (no tool calling)")
        out.append(orchestrator_pb2.ChatMessage(role="system" if m.role == "developer" else m.role,
                                                content=_content(m, i)))
    return out


def completion_prompt(prompt) -> str | list[int]:
    """A completions prompt: a string or token ids; a batch of one is unwrapped."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid("prompt", f"only one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, list) and not prompt:
        raise invalid("prompt", "the prompt is empty")
    return prompt


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    return stops


def generate_request(req: ChatCompletionRequest | CompletionRequest, drafter_from_model: str = ""
                     ) -> orchestrator_pb2.GenerateRequest:
    """The GenerateRequest for a chat or text completion (400 naming the field for what we cannot do)."""
    problem = unsupported(req)
    if problem:
        raise invalid(*problem)
    if req.drafter is not None and drafter_from_model and req.drafter != drafter_from_model:
        raise invalid("drafter", f"the model id names drafter {drafter_from_model!r}, the drafter field {req.drafter!r}")
    temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    msg = orchestrator_pb2.GenerateRequest(
        drafter=req.drafter or drafter_from_model, stop=stop_strings(req.stop),
        # A top_k beyond the vocabulary keeps every token, as does int32's largest.
        sampling=sampling_pb2.SamplingParams(temperature=temperature, top_k=min(req.top_k or 0, INT32_MAX)))
    if isinstance(req, ChatCompletionRequest):
        msg.chat.messages.extend(chat_messages(req.messages))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        prompt = completion_prompt(req.prompt)
        if isinstance(prompt, str):
            msg.text = prompt
        else:
            msg.tokens.token_ids.extend(prompt)
        max_tokens = req.max_tokens
    if max_tokens is not None:
        msg.max_new_tokens = min(max_tokens, INT32_MAX)
    if req.top_p is not None:
        msg.sampling.top_p = req.top_p
    if req.seed is not None:
        msg.seed = req.seed % 2 ** 64
    if req.k is not None:
        msg.k = min(req.k, INT32_MAX)
    return msg


def finish_reason(reason: str) -> str | None:
    return _FINISH.get(reason, reason) if reason else None


def committed_tokens(stats: orchestrator_pb2.GenerateStats | None) -> int:
    # The one place that reads the proto's names for committed tokens (being renamed on main, issue 6).
    return stats.committed_tokens if stats is not None else 0


def usage(stats: orchestrator_pb2.GenerateStats) -> dict:
    """OpenAI's token counts plus what speculative decoding did (committed = accepted + one per step)."""
    committed = committed_tokens(stats)
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": committed,
        "total_tokens": stats.prompt_tokens + committed,
        "speculative": {
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "committed_tokens": committed,
            "acceptance_rate": round(stats.acceptance_rate, 6),
            "committed_per_step": round(stats.committed_per_step, 6),
            "steps": stats.steps,
        },
    }


@dataclass
class Reply:
    """The OpenAI objects of one request, built as its chunks arrive."""

    chat: bool
    model: str
    created: int
    id: str = ""
    seed: int = 0
    drafter: str = ""
    k: int = 0
    text: str = ""
    finish: str | None = None
    stats: orchestrator_pb2.GenerateStats | None = None

    def add(self, chunk: orchestrator_pb2.GenerateChunk) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + chunk.session_id
            self.seed, self.drafter, self.k = chunk.seed, chunk.drafter, chunk.k
        self.text += chunk.text
        self.finish = finish_reason(chunk.finish_reason) or self.finish
        self.stats = chunk.stats

    @property
    def fingerprint(self) -> str:
        return f"specmesh-{self.drafter}-k{self.k}"

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def response(self) -> dict:
        """The non-streaming body: chat.completion or text_completion."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": None,
                      "finish_reason": self.finish}
        else:
            choice = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": self.finish}
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body.update(choices=[choice], usage=usage(self.stats) if self.stats is not None else None, seed=self.seed)
        return body

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False,
              with_usage_field: bool = False) -> dict:
        """One streamed chunk: a text delta, the role (first) or the finish reason (last)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = self._envelope("text_completion")
        body["choices"] = [choice]
        if with_usage_field:   # OpenAI: with include_usage, every chunk has "usage": null but the last
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict:
        """The extra last chunk of stream_options.include_usage: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage(self.stats) if self.stats is not None else None)
        return body
