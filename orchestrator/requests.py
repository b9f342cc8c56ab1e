"""Checking a GenerateRequest and turning it into a plain GenerationRequest.

Every check names the field it rejects, so a caller's INVALID_ARGUMENT says
what to fix. Nothing here touches Redis or a replica.
"""
from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field

from jinja2 import TemplateError

from specmesh import wire
from specmesh.bounds import check_session_id, shown
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
    # The draft tree's cut for this session (orchestrator/tree_cut.py): chosen by the orchestrator, never
    # the caller, and kept in the session's record. None: none sent (the draft replica's own setting).
    tree_min_confidence: float | None = None


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
    # Configured bounds (OrchestratorConfig); None: only the context bounds.
    max_prompt_tokens: int | None = None
    max_total_tokens: int | None = None
    max_stop_strings: int = 16


MAX_STOP_CHARS = 256   # longer than any stop sequence in use; each step searches the text for each


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
                raise InvalidArgument(f"chat.messages[{i}].role",
                                      f"must be system, user or assistant, got {shown(m['role'])}")
        if tokenizer.chat_template is None:
            raise InvalidArgument("chat", "the target model has no chat template; send text instead")
        try:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as error:   # templates raise on what they refuse (e.g. roles out of order)
            raise InvalidArgument("chat.messages", f"the target's chat template refused them: {error}") from None
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    if which == "tokens":
        if not msg.tokens.token_ids:
            raise InvalidArgument("tokens.token_ids", "the prompt is empty")
        return list(msg.tokens.token_ids)
    raise InvalidArgument("prompt", "set one of text, chat or tokens")


def validate(msg: orchestrator_pb2.GenerateRequest, prompt_ids: list[int], limits: Limits) -> GenerationRequest:
    if msg.session_id:
        check_session_id(msg.session_id)
    if not prompt_ids:
        raise InvalidArgument("prompt", "it encodes to no tokens")
    check_token_ids("tokens.token_ids", prompt_ids, limits.vocab_size)
    if limits.max_prompt_tokens and len(prompt_ids) > limits.max_prompt_tokens:
        raise InvalidArgument("prompt",
                              f"{len(prompt_ids)} tokens exceed max_prompt_tokens = {limits.max_prompt_tokens}")
    drafter = msg.drafter or limits.default_drafter
    if drafter not in limits.drafters:
        raise InvalidArgument("drafter", f"unknown drafter {shown(drafter)}; available: {sorted(limits.drafters)}")
    k = msg.k if msg.HasField("k") else limits.default_k
    if not 0 <= k <= limits.max_k:
        raise InvalidArgument("k", f"must be in [0, {limits.max_k}], got {k}")
    context = limits.max_context
    if k and limits.drafter_context.get(drafter):
        context = min(context, limits.drafter_context[drafter])
    limit = f"the context of {context}"
    if limits.max_total_tokens and limits.max_total_tokens < context:
        context, limit = limits.max_total_tokens, f"max_total_tokens = {limits.max_total_tokens}"
    room = context - len(prompt_ids)
    if room < 1:
        raise InvalidArgument("prompt", f"{len(prompt_ids)} prompt tokens leave no room in {limit}")
    max_new = msg.max_new_tokens if msg.HasField("max_new_tokens") else min(limits.default_max_new_tokens, room)
    if max_new <= 0:
        raise InvalidArgument("max_new_tokens", f"must be > 0, got {max_new}")
    if max_new > room:
        raise InvalidArgument("max_new_tokens", f"{len(prompt_ids)} prompt tokens + {max_new} new tokens exceed "
                                                f"{limit}")
    params = wire.sampling_from_pb(msg.sampling)
    if len(msg.stop) > limits.max_stop_strings:
        raise InvalidArgument("stop", f"at most {limits.max_stop_strings} stop strings, got {len(msg.stop)}")
    if any(not 0 < len(s) <= MAX_STOP_CHARS for s in msg.stop):
        raise InvalidArgument("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return GenerationRequest(
        session_id=msg.session_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        params=params,
        seed=msg.seed if msg.HasField("seed") else secrets.randbits(63),
        stop=tuple(msg.stop),
        k=k,
        drafter=drafter,
    )
