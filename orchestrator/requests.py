"""Checking a GenerateRequest and turning it into a plain GenerationRequest.

Every check names the field it rejects, so a caller's INVALID_ARGUMENT says
what to fix. Nothing here touches Redis or a replica.
"""
from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass, field

from specmesh import wire
from specmesh.errors import InvalidArgument, check_token_ids
from specmesh.sampling import SamplingParams
from specmesh.v1 import orchestrator_pb2


@dataclass(frozen=True)
class GenerationRequest:
    session_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    stop: tuple[str, ...]
    k: int
    drafter: str


@dataclass(frozen=True)
class Limits:
    """What the deployment allows, learned from configuration and the replicas."""

    max_context: int
    vocab_size: int
    max_k: int
    default_k: int
    default_max_new_tokens: int
    drafters: frozenset[str]
    default_drafter: str
    # A drafter's own context limit, where it has one (a draft model may be shorter than the target).
    drafter_context: dict[str, int] = field(default_factory=dict)


def tokenize_prompt(msg: orchestrator_pb2.GenerateRequest, tokenizer) -> list[int]:
    which = msg.WhichOneof("prompt")
    if which == "text":
        if not msg.text.strip():
            raise InvalidArgument("text", "the prompt is empty")
        return list(tokenizer(msg.text).input_ids)
    if which == "chat":
        if not msg.chat.messages:
            raise InvalidArgument("chat.messages", "no messages")
        messages = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
        for i, m in enumerate(messages):
            if m["role"] not in ("system", "user", "assistant"):
                raise InvalidArgument(f"chat.messages[{i}].role", f"must be system, user or assistant, got {m['role']!r}")
        if tokenizer.chat_template is None:
            raise InvalidArgument("chat", "the target model has no chat template; send text instead")
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    if which == "tokens":
        if not msg.tokens.token_ids:
            raise InvalidArgument("tokens.token_ids", "the prompt is empty")
        return list(msg.tokens.token_ids)
    raise InvalidArgument("prompt", "set one of text, chat or tokens")


def validate(msg: orchestrator_pb2.GenerateRequest, prompt_ids: list[int], limits: Limits) -> GenerationRequest:
    check_token_ids("tokens.token_ids", prompt_ids, limits.vocab_size)
    drafter = msg.drafter or limits.default_drafter
    if drafter not in limits.drafters:
        raise InvalidArgument("drafter", f"unknown drafter {drafter!r}; available: {sorted(limits.drafters)}")
    k = msg.k if msg.HasField("k") else limits.default_k
    if not 0 <= k <= limits.max_k:
        raise InvalidArgument("k", f"must be in [0, {limits.max_k}], got {k}")
    context = limits.max_context
    if k and limits.drafter_context.get(drafter):
        context = min(context, limits.drafter_context[drafter])
    room = context - len(prompt_ids)
    if room < 1:
        raise InvalidArgument("prompt", f"{len(prompt_ids)} prompt tokens leave no room in the context of {context}")
    max_new = msg.max_new_tokens if msg.HasField("max_new_tokens") else min(limits.default_max_new_tokens, room)
    if max_new <= 0:
        raise InvalidArgument("max_new_tokens", f"must be > 0, got {max_new}")
    if max_new > room:
        raise InvalidArgument("max_new_tokens", f"{len(prompt_ids)} prompt tokens + {max_new} new tokens exceed "
                                                f"the context of {context}")
    s = msg.sampling
    if not s.temperature >= 0 or math.isinf(s.temperature):   # also rejects NaN
        raise InvalidArgument("sampling.temperature", f"must be a finite number >= 0, got {s.temperature}")
    if s.top_k < 0:
        raise InvalidArgument("sampling.top_k", f"must be >= 0 (0 disables), got {s.top_k}")
    if s.HasField("top_p") and not 0 < s.top_p <= 1:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
    if any(not s for s in msg.stop):
        raise InvalidArgument("stop", "stop strings must not be empty")
    return GenerationRequest(
        session_id=msg.session_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        params=wire.sampling_from_pb(s),
        seed=msg.seed if msg.HasField("seed") else secrets.randbits(63),
        stop=tuple(msg.stop),
        k=k,
        drafter=drafter,
    )
