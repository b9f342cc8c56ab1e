"""Each service's settings: one frozen dataclass, filled from CLI flags, which
default to environment variables, which default to the values here.

Environment variables are what the Helm chart sets; flags are what a person
types. `SETTING_ENV` maps each field to its variable.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from specmesh.models import DEFAULT_MODEL


@dataclass(frozen=True)
class DraftConfig:
    port: int = 50061
    # Optional small causal LM sharing the target's vocabulary; without one
    # only model-free drafters (n-gram prompt lookup) are served.
    draft_model: str | None = None
    device: str = "cpu"
    max_k: int = 8
    # Which drafter answers a request that names none: the model when there is one, except for a
    # shipped draft, whose measured choice is in specmesh.drafts.SHIPPED_DEFAULT_DRAFTER.
    default_drafter: str | None = None
    # Per-session state is cheap to lose (Redis can rebuild it), so bound it hard.
    max_sessions: int = 256
    session_idle_s: float = 600.0
    # Prompt lookup: match the last ngram_max..ngram_min tokens. A one-token
    # match proposes often and is rarely right: on Spec-Bench with SmolLM2 a
    # minimum of 2 doubled the acceptance rate (0.13 -> 0.33 at k = 4), and a
    # step without a proposal costs only a plain target step.
    ngram_max: int = 3
    ngram_min: int = 2
    # torch intra-op threads. Drafting is latency-bound small work: one thread,
    # leaving the cores to the verifier when the tiers share a machine.
    torch_threads: int = 1
    metrics_port: int | None = None


@dataclass(frozen=True)
class VerifierConfig:
    port: int = 50062
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str | None = None
    max_sessions: int = 64
    session_idle_s: float = 600.0
    # Verify calls that queue while the model is busy share its next forward
    # pass (up to max_batch; 1 disables batching). A window > 0 also holds a
    # lone call that long for company: more throughput, more latency.
    batch_window_ms: float = 0.0
    max_batch: int = 16
    torch_threads: int = 0              # 0: torch's default (every core)
    metrics_port: int | None = None


@dataclass(frozen=True)
class OrchestratorConfig:
    port: int = 50051
    model: str = DEFAULT_MODEL          # the target's tokenizer and chat template
    draft_addrs: tuple[str, ...] = ("localhost:50061",)
    verifier_addrs: tuple[str, ...] = ("localhost:50062",)
    redis_url: str = "redis://localhost:6379/0"
    session_ttl_s: int = 3600
    default_k: int = 4
    max_k: int = 8
    default_max_new_tokens: int = 128
    default_drafter: str = ""          # empty: the draft service's default
    # Each drafted position's proposal q is truncated to this many tokens; the
    # rule stays exact and a step's message stays O(k * top_n), not O(k * vocab).
    draft_top_n: int = 8
    max_active_sessions: int = 256
    rpc_timeout_s: float = 60.0
    # How long a step keeps retrying when every replica of a tier fails (a
    # rolling restart, a rescheduled pod) before the client gets UNAVAILABLE.
    replica_retry_s: float = 20.0
    metrics_port: int | None = None


SETTING_ENV = {
    "port": "SPECMESH_PORT",
    "draft_model": "SPECMESH_DRAFT_MODEL",
    "model": "SPECMESH_MODEL",
    "device": "SPECMESH_DEVICE",
    "dtype": "SPECMESH_DTYPE",
    "max_k": "SPECMESH_MAX_K",
    "default_k": "SPECMESH_DEFAULT_K",
    "default_drafter": "SPECMESH_DEFAULT_DRAFTER",
    "max_sessions": "SPECMESH_MAX_SESSIONS",
    "session_idle_s": "SPECMESH_SESSION_IDLE_S",
    "batch_window_ms": "SPECMESH_BATCH_WINDOW_MS",
    "max_batch": "SPECMESH_MAX_BATCH",
    "draft_addrs": "SPECMESH_DRAFT_ADDRS",
    "verifier_addrs": "SPECMESH_VERIFIER_ADDRS",
    "redis_url": "REDIS_URL",
    "session_ttl_s": "SPECMESH_SESSION_TTL_S",
    "default_max_new_tokens": "SPECMESH_DEFAULT_MAX_NEW_TOKENS",
    "draft_top_n": "SPECMESH_DRAFT_TOP_N",
    "max_active_sessions": "SPECMESH_MAX_ACTIVE_SESSIONS",
    "rpc_timeout_s": "SPECMESH_RPC_TIMEOUT_S",
    "replica_retry_s": "SPECMESH_REPLICA_RETRY_S",
    "metrics_port": "SPECMESH_METRICS_PORT",
    "torch_threads": "SPECMESH_TORCH_THREADS",
    "ngram_max": "SPECMESH_NGRAM_MAX",
    "ngram_min": "SPECMESH_NGRAM_MIN",
}


def _convert(value: str, typ) -> object:
    typ = str(typ)
    if "tuple" in typ:
        return tuple(a.strip() for a in value.split(",") if a.strip())
    if "int" in typ:
        return int(value)
    if "float" in typ:
        return float(value)
    return value


def from_env(cls, overrides: dict | None = None, environ=os.environ):
    """Build `cls` from its defaults, then the environment, then non-None overrides."""
    values = {}
    for f in dataclasses.fields(cls):
        env = SETTING_ENV.get(f.name)
        if env and environ.get(env):
            values[f.name] = _convert(environ[env], f.type)
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _convert(value, types[name]) if isinstance(value, str) else value
    if cls is OrchestratorConfig and environ.get("REDIS_PASSWORD"):
        values["redis_url"] = with_password(values.get("redis_url", cls.redis_url), environ["REDIS_PASSWORD"])
    return cls(**values)


def with_password(url: str, password: str) -> str:
    """Put a password (kept in a Secret, apart from the URL) into a redis:// URL."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        return url
    host = parts.hostname or "localhost"
    netloc = f"{parts.username or ''}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
