from specmesh.v1 import sampling_pb2 as _sampling_pb2
from specmesh.v1 import cache_pb2 as _cache_pb2
from specmesh.v1 import draft_pb2 as _draft_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "return_features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    return_features: bool
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., return_features: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("cached_len", "features")
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    cached_len: int
    features: bytes
    def __init__(self, cached_len: _Optional[int] = ..., features: _Optional[bytes] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "sync", "proposals", "sampling", "seed", "return_features", "parents")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sync: _cache_pb2.CacheSync
    proposals: _containers.RepeatedCompositeFieldContainer[_draft_pb2.DraftProposal]
    sampling: _sampling_pb2.SamplingParams
    seed: int
    return_features: bool
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., sync: _Optional[_Union[_cache_pb2.CacheSync, _Mapping]] = ..., proposals: _Optional[_Iterable[_Union[_draft_pb2.DraftProposal, _Mapping]]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., return_features: _Optional[bool] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("target_probs", "recovered_tokens", "bonus_token", "cached_len", "features", "features_start", "end_tokens")
    TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_START_FIELD_NUMBER: _ClassVar[int]
    END_TOKENS_FIELD_NUMBER: _ClassVar[int]
    target_probs: _containers.RepeatedScalarFieldContainer[float]
    recovered_tokens: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    cached_len: int
    features: bytes
    features_start: int
    end_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, target_probs: _Optional[_Iterable[float]] = ..., recovered_tokens: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., cached_len: _Optional[int] = ..., features: _Optional[bytes] = ..., features_start: _Optional[int] = ..., end_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "vocab_fingerprint", "max_context", "eos_token_ids", "cached_sessions", "feature_dim", "verify_cost")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COST_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    vocab_fingerprint: str
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_sessions: int
    feature_dim: int
    verify_cost: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., cached_sessions: _Optional[int] = ..., feature_dim: _Optional[int] = ..., verify_cost: _Optional[_Iterable[float]] = ...) -> None: ...
