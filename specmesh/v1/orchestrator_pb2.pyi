from specmesh.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenPrompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "tokens", "max_new_tokens", "sampling", "seed", "stop", "k", "drafter", "session_id", "resume_offset")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatPrompt
    tokens: TokenPrompt
    max_new_tokens: int
    sampling: _sampling_pb2.SamplingParams
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    k: int
    drafter: str
    session_id: str
    resume_offset: int
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., tokens: _Optional[_Union[TokenPrompt, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., k: _Optional[int] = ..., drafter: _Optional[str] = ..., session_id: _Optional[str] = ..., resume_offset: _Optional[int] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("draft_tokens", "accepted_tokens", "bonus", "recovered")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: int
    accepted_tokens: int
    bonus: bool
    recovered: bool
    def __init__(self, draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., bonus: _Optional[bool] = ..., recovered: _Optional[bool] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("steps", "draft_tokens", "accepted_tokens", "committed_tokens", "recovered_tokens", "bonus_tokens", "prompt_tokens", "acceptance_rate", "committed_per_step", "tokens_per_second", "time_to_first_token_s", "elapsed_s")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    steps: int
    draft_tokens: int
    accepted_tokens: int
    committed_tokens: int
    recovered_tokens: int
    bonus_tokens: int
    prompt_tokens: int
    acceptance_rate: float
    committed_per_step: float
    tokens_per_second: float
    time_to_first_token_s: float
    elapsed_s: float
    def __init__(self, steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., committed_tokens: _Optional[int] = ..., recovered_tokens: _Optional[int] = ..., bonus_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., committed_per_step: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("session_id", "offset", "text", "token_ids", "step", "finish_reason", "stats", "seed", "drafter", "k")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    offset: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    step: StepStats
    finish_reason: str
    stats: GenerateStats
    seed: int
    drafter: str
    k: int
    def __init__(self, session_id: _Optional[str] = ..., offset: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., step: _Optional[_Union[StepStats, _Mapping]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., seed: _Optional[int] = ..., drafter: _Optional[str] = ..., k: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("session_id", "text", "token_ids", "finish_reason", "stats", "seed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerateStats
    seed: int
    def __init__(self, session_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterModel(_message.Message):
    __slots__ = ("name", "model")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("target_model", "max_context", "drafters", "default_drafter", "default_k", "max_k")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_K_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    max_context: int
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterModel]
    default_drafter: str
    default_k: int
    max_k: int
    def __init__(self, target_model: _Optional[str] = ..., max_context: _Optional[int] = ..., drafters: _Optional[_Iterable[_Union[DrafterModel, _Mapping]]] = ..., default_drafter: _Optional[str] = ..., default_k: _Optional[int] = ..., max_k: _Optional[int] = ...) -> None: ...
