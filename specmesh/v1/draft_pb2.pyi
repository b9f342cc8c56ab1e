from specmesh.v1 import sampling_pb2 as _sampling_pb2
from specmesh.v1 import cache_pb2 as _cache_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "sync", "k", "drafter", "sampling", "seed", "top_n", "features", "tree_min_confidence")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sync: _cache_pb2.CacheSync
    k: int
    drafter: str
    sampling: _sampling_pb2.SamplingParams
    seed: int
    top_n: int
    features: bytes
    tree_min_confidence: float
    def __init__(self, session_id: _Optional[str] = ..., sync: _Optional[_Union[_cache_pb2.CacheSync, _Mapping]] = ..., k: _Optional[int] = ..., drafter: _Optional[str] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., top_n: _Optional[int] = ..., features: _Optional[bytes] = ..., tree_min_confidence: _Optional[float] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("token_id", "q_ids", "q_probs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    q_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., q_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("proposals", "cached_len", "parents")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    cached_len: int
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ..., cached_len: _Optional[int] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("name", "model", "vocab_size", "vocab_fingerprint", "max_context", "uses_target_features", "feature_dim")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    USES_TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    vocab_size: int
    vocab_fingerprint: str
    max_context: int
    uses_target_features: bool
    feature_dim: int
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., max_context: _Optional[int] = ..., uses_target_features: _Optional[bool] = ..., feature_dim: _Optional[int] = ...) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("drafters", "default_drafter", "max_k", "cached_sessions")
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    CACHED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterInfo]
    default_drafter: str
    max_k: int
    cached_sessions: int
    def __init__(self, drafters: _Optional[_Iterable[_Union[DrafterInfo, _Mapping]]] = ..., default_drafter: _Optional[str] = ..., max_k: _Optional[int] = ..., cached_sessions: _Optional[int] = ...) -> None: ...
