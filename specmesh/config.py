"""Each service's settings: one frozen dataclass, the only place a setting is defined.

A field's default carries its reason in `setting(default, help)`. Everything
else is generated from the fields (`specmesh.settings`): the command-line flag
(`--max-k`), the environment variable (`SPECMESH_MAX_K`, what the Helm chart
sets), the README's settings table and the chart's values schema. A flag wins
over the environment, which wins over the default.
"""
from __future__ import annotations

from dataclasses import dataclass

from specmesh.bounds import DEFAULT_MAX_MESSAGE_BYTES
from specmesh.models import DEFAULT_MODEL
from specmesh.settings import setting
from specmesh.tls import ChannelTLS, ServerTLS, channel_tls, server_tls

# The ways a model's linear layers can run: see specmesh/fast_linear.py.
LINEAR_KERNELS = ("packed", "bf16", "stock", "int8-dynamic")


def _check_kernels(config) -> None:
    if config.linear_kernels not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernels must be one of {', '.join(LINEAR_KERNELS)}, got {config.linear_kernels!r}")
    if not 0 <= config.min_product_rows <= 64:
        raise ValueError(f"min_product_rows must be 0 (measure at start-up) or 1-64, got {config.min_product_rows}")


MIN_PRODUCT_ROWS_HELP = (
    "the fewest rows a oneDNN product runs with (packed or bf16 kernels): a thinner product (a 1- to few-token "
    "step's) is padded with copies of its last row, which changes no bits (rows do not depend on how many there "
    "are) but picks oneDNN's kernel; which is fastest depends on the CPU (2 on AVX2 EPYCs; 4 on an AVX-512 "
    "Zen 4, where the 135M target's 1-token step took 0.83x the time); 0: measured at start-up and logged")


@dataclass(frozen=True)
class ServiceSettings:
    """What every gRPC tier (draft, verifier, orchestrator) takes alike."""

    host: str = setting("[::]", "interface to listen on (and serve metrics on): [::] every one, as in a pod; "
                               "`specmesh up` uses 127.0.0.1")
    internal_token_file: str | None = setting(
        None, "a file holding the token internal calls carry (orchestrator -> draft and verifier; a mounted "
              "Secret); set on all three tiers to lock the internal APIs; unset: they are open")
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES,
        "largest gRPC message received or sent (the orchestrator's: also on its channels to the replicas); a "
        "bigger one is refused with RESOURCE_EXHAUSTED before it is parsed. 16 MiB: a whole context of the "
        "target's features (an EAGLE draft's prefill: 2 bytes x hidden size a token) fits; raise it for a target "
        "with a wider hidden state and a long context")
    metrics_port: int | None = setting(None, "serve Prometheus /metrics on this port; unset: no metrics")
    tls_cert_file: str | None = setting(
        None, "PEM certificate (chain) of this service: with tls_key_file its gRPC port speaks TLS only; the "
              "orchestrator also presents it to the draft and verifier (mutual TLS); re-read when it changes "
              "(a mounted Secret that cert-manager renews)")
    tls_key_file: str | None = setting(None, "PEM private key of tls_cert_file")
    tls_client_ca_file: str | None = setting(
        None, "PEM CA bundle: a caller must present a certificate it signed (mutual TLS), or gets no connection; "
              "set on the draft and verifier to admit only holders of the internal certificate")

    def server_tls(self) -> ServerTLS | None:
        return server_tls(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)


@dataclass(frozen=True)
class DraftConfig(ServiceSettings):
    port: int = setting(50061, "gRPC port of the Draft service")
    draft_model: str | None = setting(
        None, "a small causal LM sharing the target's vocabulary (HF folder, hub id or .gguf); "
              "without one only model-free drafters (n-gram prompt lookup) are served")
    eagle_model: str | None = setting(
        None, "an EAGLE draft folder (`specmesh distill --arch eagle`) or a shipped one's name, served as the "
              "`eagle` drafter: it reads the target's features, which the orchestrator then asks the verifier "
              "for; unset or 'none': not served (`specmesh up` serves the default target's shipped one)")
    draft_head_tokens: int = setting(
        2048, "a distilled or EAGLE draft proposes among its N most frequent tokens only (FR-Spec): a draft token "
              "reads the whole output head, the bulk of its cost on a CPU, so the shipped drafts' 5-8k-row heads "
              "cost 1.4-2x a 2k one; held-out acceptance moved by <1% (docs/benchmarks.md); 0: the whole head")
    tree_branch: int = setting(
        3, "the EAGLE drafters propose a draft tree of k nodes (specmesh/tree.py): each round expands the "
           "best nodes of the newest layer, this many children each, and the k best paths are verified in one "
           "pass; 1: a chain. At the same k (the same verify cost) a tree commits more tokens per step, and "
           "costs the draft less than a chain: held-out at k = 4, 1.89 against 1.76, 6.8 against 9.5 ms "
           "(docs/distill.md)")
    tree_depth: int = setting(
        3, "the deepest a draft tree grows (min with k): one draft pass per layer, so this bounds the draft's "
           "time per step; at k = 4, depth 3 accepted what depth 4 did held-out for 2.5 ms less a step. A wide "
           "tree (large k, on a GPU) wants more: 16 nodes at depth 6 with tree_branch 4 committed 2.17 tokens "
           "per step held-out")
    tree_min_confidence: float | None = setting(
        None, "the EAGLE drafters' trees keep only nodes whose whole path the draft gives at least this chance "
              "(EAGLE-2's dynamic tree, cut by confidence): fewer nodes, none at all, and fewer draft passes "
              "where the draft is unsure. Unset: each Propose's cut, which the orchestrator chooses per session "
              "from what the verifier measured a verified token to cost (2 x its share of a 1-token step: 0.12 "
              "on an AVX2 CPU, where a fixed 0.1 took Spec-Bench from 1.42x to 1.50x; 0.03 on a Zen 4 CPU; about "
              "0 on a GPU, which verifies 16 nodes for the cost of 4; docs/distill.md), else 0. Set: this cut "
              "for every Propose, whatever it asks; 0: every tree has k nodes")
    device: str = setting("cpu", "cpu or cuda")
    max_k: int = setting(8, "most draft tokens one Propose may return")
    default_drafter: str | None = setting(
        None, "the drafter for a request that names none; unset: for a shipped draft, the measured choice in "
              "specmesh.drafts.SHIPPED_DEFAULT_DRAFTER (eagle-hybrid with the default target's EAGLE draft, "
              "ngram with its plain one; an EAGLE draft of your own gets eagle-hybrid too), else the model when "
              "there is one, else ngram")
    default_top_n: int = setting(
        8, "tokens kept of each proposal q when a caller leaves top_n unset: a truncated q is still exact, "
           "and a step's message stays O(k * top_n), not O(k * vocabulary)")
    max_sessions: int = setting(
        256, "sessions cached before least-recently-used eviction; cheap to lose (Redis can rebuild them), "
             "so bounded hard")
    session_idle_s: float = setting(600.0, "a session cache idle this long is dropped (its next call re-prefills)")
    max_cache_bytes: int | None = setting(
        None, "KV-cache bytes held before the least recently used sessions are evicted (their next call "
              "re-prefills; the output is unchanged); unset: only max_sessions bounds memory")
    ngram_max: int = setting(3, "prompt lookup: longest suffix n-gram matched")
    ngram_min: int = setting(
        2, "prompt lookup: shortest suffix n-gram matched; on Spec-Bench with SmolLM2 a minimum of 2 doubled "
           "the acceptance rate of 1 (0.13 -> 0.33 at k = 4), and a step without a proposal costs only a "
           "plain target step")
    torch_threads: int = setting(
        1, "torch intra-op threads; drafting is latency-bound small work, so one thread leaves the cores "
           "to the verifier when tiers share a machine")
    linear_kernels: str = setting(
        "bf16", choices=LINEAR_KERNELS,
        help="how the draft model's linear layers run (specmesh/fast_linear.py): bf16 (weights packed once for "
             "oneDNN in bfloat16: a draft token on a CPU is bound by reading the weights, and bf16 halves that; "
             "the shipped drafts proposed the same held-out tokens as in fp32), packed (fp32), stock or "
             "int8-dynamic; a draft may be quantized freely, the rule stays exact and only acceptance moves")

    batch_invariant: bool = setting(
        True, "compute every draft position the same way however it is chunked or rebuilt (oneDNN products for "
              "the linear layers and attention; specmesh/invariant.py), so a draft replica rebuilt after a crash "
              "proposes the same q bit for bit and sampled outputs stay identical; needs linear_kernels=packed or bf16 "
              "on an fp32 CPU model")
    min_product_rows: int = setting(0, MIN_PRODUCT_ROWS_HELP)

    def __post_init__(self):
        _check_kernels(self)
        if self.tree_depth < 1:
            raise ValueError(f"tree_depth must be >= 1, got {self.tree_depth}")
        if self.tree_branch < 1:
            raise ValueError(f"tree_branch must be >= 1 (1: a chain), got {self.tree_branch}")
        if self.tree_min_confidence is not None and not 0.0 <= self.tree_min_confidence < 1.0:
            raise ValueError(f"tree_min_confidence must be in [0, 1) (0: off), got {self.tree_min_confidence}")
        if self.draft_head_tokens < 0:
            raise ValueError(f"draft_head_tokens must be >= 0 (0: the whole head), got {self.draft_head_tokens}")


@dataclass(frozen=True)
class VerifierConfig(ServiceSettings):
    port: int = setting(50062, "gRPC port of the Verifier service")
    model: str = setting(DEFAULT_MODEL, "the target: 'smollm2' (embedded), an HF folder or hub id, or a .gguf file")
    device: str = setting("cpu", "cpu or cuda")
    dtype: str | None = setting(None, "float32, bfloat16 or float16; unset: float32 (bf16 is slower on AVX2 CPUs)")
    max_sessions: int = setting(64, "KV caches held before least-recently-used eviction")
    session_idle_s: float = setting(600.0, "a KV cache idle this long is dropped (its next call re-prefills)")
    max_cache_bytes: int | None = setting(
        None, "KV-cache bytes held before the least recently used sessions are evicted (their next call "
              "re-prefills; the output is unchanged); unset: only max_sessions bounds memory")
    batch_window_ms: float = setting(
        0.0, "hold a lone Verify this long for company in the next forward pass: more throughput, more "
             "latency; 0 batches only calls that queued while the model was busy")
    max_batch: int = setting(16, "most Verify calls sharing one forward pass; 1 disables batching")
    torch_threads: int = setting(0, "torch intra-op threads; 0: torch's default (every core)")
    prefill_threads: int = setting(
        0, "torch intra-op threads while reading a prompt (Prefill, or a Verify that rebuilds a lost cache of "
           "64+ tokens): where the tiers share a machine the draft "
           "idles then, waiting for the prompt's features, so the prompt can use every core (`specmesh up` sets "
           "it so: the first token came 30-40% sooner); the logits are the same bits; 0: torch_threads")
    linear_kernels: str = setting(
        "packed", choices=LINEAR_KERNELS,
        help="how the target's linear layers run (specmesh/fast_linear.py): packed (weights pre-packed once for "
             "oneDNN, so a (k + 1)-token Verify costs ~1.05x a 1-token step instead of 1.5-2x with stock MKL on "
             "CPU; same outputs to float rounding; +1 weight copy, 1-2 s at start-up; a no-op on GPUs), stock, "
             "or bf16 / int8-dynamic (a different target: only on request)")
    batch_invariant: bool = setting(
        True, "compute a position's logits the same way whoever shares its forward pass and however its cache "
              "was built (step by step, one prefill, a rebuild after a crash): oneDNN products for the linear "
              "layers and attention (specmesh/invariant.py), so sampled outputs are identical under batching "
              "and failover, not just greedy ones; needs linear_kernels=packed (or bf16) on an fp32 CPU model; off: stock "
              "SDPA attention, which rounds by shape")
    min_product_rows: int = setting(0, MIN_PRODUCT_ROWS_HELP)

    __post_init__ = _check_kernels


@dataclass(frozen=True)
class OrchestratorConfig(ServiceSettings):
    port: int = setting(50051, "gRPC port of the public Orchestrator API")
    auth_tokens_file: str | None = setting(
        None, "bearer tokens accepted on the public API, one per line (a mounted Secret), re-read when the file "
              "changes; a call without one is UNAUTHENTICATED; unset: no authentication")
    model: str = setting(DEFAULT_MODEL, "the target, for its tokenizer and chat template")
    draft_addrs: tuple[str, ...] = setting(("localhost:50061",), "draft replicas, comma-separated host:port")
    verifier_addrs: tuple[str, ...] = setting(("localhost:50062",), "verifier replicas, comma-separated host:port")
    tls_ca_file: str | None = setting(
        None, "PEM CA bundle the draft and verifier certificates must chain to: set, calls to them use TLS (and "
              "present tls_cert_file and tls_key_file, for replicas that require mutual TLS); re-read when it "
              "changes")
    redis_url: str = setting("redis://localhost:6379/0", "sessions live here; REDIS_PASSWORD, if set, is added "
                                                         "to it (so the password can come from a Secret)",
                             env="REDIS_URL")
    session_ttl_s: int = setting(3600, "a session record untouched this long expires from Redis")
    finished_ttl_s: int = setting(
        300, "a finished session's record stays this long, so a client that lost the last chunks can resume "
             "and get them with the same finish reason, instead of NOT_FOUND; 0: deleted when it finishes")
    redis_retry_s: float = setting(
        5.0, "how long a Redis command is retried while Redis is unreachable (a restart, a failover) before "
             "the client gets UNAVAILABLE: streams in flight ride out a blip this long")
    default_k: int = setting(
        5, "draft tokens per step for a request that sets none; 5 fills a 6-token verify, which costs what "
           "a 5-token one does on an AVX2 CPU, and the default draft tree grows 5 nodes for the draft passes "
           "of 4 (docs/distill.md: 2% faster than k = 4 in each of three Spec-Bench runs)")
    max_k: int = setting(8, "most draft tokens per step a request may ask for")
    default_max_new_tokens: int = setting(128, "max_new_tokens for a request that sets none")
    default_drafter: str = setting("", "the drafter for a request that names none; empty: the draft tier's default")
    draft_top_n: int = setting(
        8, "tokens kept of each proposal q: a truncated q keeps the rule exact and a step's message "
           "O(k * top_n), not O(k * vocabulary)")
    max_active_sessions: int = setting(256, "streams decoded at once; more get RESOURCE_EXHAUSTED")
    torch_threads: int = setting(
        1, "torch intra-op threads; the accept rule works on a step's few proposals, so one thread leaves the "
           "cores to the draft and verifier when tiers share a machine")
    max_prompt_tokens: int | None = setting(
        None, "longest prompt accepted, in tokens; longer gets INVALID_ARGUMENT. Unset: whatever leaves one "
              "token of room in the target's context")
    max_total_tokens: int | None = setting(
        None, "longest prompt + max_new_tokens accepted; more gets INVALID_ARGUMENT, and an unset "
              "max_new_tokens is cut to fit. Unset: the target's context")
    max_stop_strings: int = setting(
        16, "most stop strings one request may give (each at most 256 characters); every step searches the "
            "text for each")
    rpc_timeout_s: float = setting(60.0, "deadline of one Propose, Verify or Prefill call")
    rpc_timeout_s_per_1k_tokens: float = setting(
        30.0, "more deadline per 1,000 tokens a call sends (a long prompt's Prefill, a cache rebuilt from the "
              "start): a busy replica is not a dead one")
    replica_retry_s: float = setting(
        20.0, "how long a step waits for a replica when every replica of a tier fails (a rolling restart, a "
              "rescheduled pod) before the client gets UNAVAILABLE")

    def channel_tls(self) -> ChannelTLS | None:
        """TLS of the orchestrator's calls to the draft and verifier tiers."""
        return channel_tls(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)


@dataclass(frozen=True)
class GatewayConfig:
    http_port: int = setting(
        8000, "HTTP port of the OpenAI-compatible API: where vLLM, llama.cpp's and TGI's servers listen, so "
              "clients' defaults work")
    host: str = setting("0.0.0.0", "interface the HTTP server binds")
    orchestrator_addr: str = setting("localhost:50051", "the orchestrator's public gRPC API (in the chart: "
                                                        "the orchestrator Service)")
    max_body_bytes: int = setting(
        4 * 1024 * 1024, "bodies past this get 413 before any parsing; 4 MiB holds a prompt filling a "
                         "128k-token context several times over, and bounds what one request can make this "
                         "process hold")
    served_model_name: str = setting("", "the model id clients send and /v1/models lists; empty: the target "
                                         "model's name as the verifier reports it")
    request_timeout_s: float = setting(600.0, "deadline of one completion on the orchestrator (its longest "
                                              "generation, not a step)")
    sse_ping_s: float = setting(15.0, "SSE comment lines on an idle stream keep proxies from closing it during "
                                      "a long prefill")
    shutdown_grace_s: float = setting(30.0, "on SIGTERM, open streams get this long to finish")
    access_log: bool = setting(False, "one log line per HTTP request; off by default (the metrics count "
                                      "requests)")
    tls_cert_file: str | None = setting(
        None, "PEM certificate (chain): with tls_key_file the gateway serves HTTPS, and presents it to an "
              "orchestrator that requires mutual TLS; read at start-up (restart to rotate)")
    tls_key_file: str | None = setting(None, "PEM private key of tls_cert_file")
    tls_ca_file: str | None = setting(
        None, "PEM CA bundle the orchestrator's certificate must chain to: set, the gateway calls it over TLS")

    def channel_tls(self) -> ChannelTLS | None:
        return channel_tls(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)

    def https(self) -> bool:
        """Whether the gateway serves HTTPS; half a pair is an error, not plain HTTP."""
        return server_tls(self.tls_cert_file, self.tls_key_file) is not None


SERVICE_CONFIGS = {"draft": DraftConfig, "verifier": VerifierConfig, "orchestrator": OrchestratorConfig,
                   "gateway": GatewayConfig}
