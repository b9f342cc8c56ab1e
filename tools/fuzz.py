"""Fuzz the live services at the byte and the field level, and count the statuses.

    python -m tools.fuzz                            # start a stack with the default model, 1,000 requests
    python -m tools.fuzz --requests 200 --seed 3    # fewer, another sequence
    python -m tools.fuzz --orchestrator localhost:50051 --draft localhost:50061 --verifier localhost:50062

Each request is one of:

* random bytes, or a valid message with bytes flipped, cut short or a string
  field of arbitrary (often invalid UTF-8) bytes spliced in, sent as the
  serialized request of any method of the three services (a raw channel with
  identity serializers, so nothing is checked before the server sees it);
* a GenerateRequest, ProposeRequest, VerifyRequest, PrefillRequest, Cancel
  or Release with random field values: NaN, infinities, subnormals, extreme
  integers, empty and long lists, session ids of any length and charset.

A proper status is OK or one that blames the request or a limit. UNKNOWN or
INTERNAL (an exception escaped a handler), UNAVAILABLE (a process died),
DEADLINE_EXCEEDED (a hang) and the rest are failures. Afterwards every
service must still be SERVING and a greedy request must give what it gave
before. The strategies are shared with tests/test_fuzz.py, which runs a few
examples of each in CI; this command runs the count for a report.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from specmesh.bounds import MAX_SESSION_ID_CHARS
from specmesh.v1 import cache_pb2, draft_pb2, orchestrator_pb2, sampling_pb2, verifier_pb2, verifier_pb2_grpc

# Statuses a caller may get for what it sent: the request's fault, a limit, a state it must repair.
PROPER = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.ALREADY_EXISTS})

INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOAT32 = st.floats(width=32)                      # NaN, +-inf, subnormals, -0.0 included
UNIT = st.floats(0, 1, width=32)


@dataclass(frozen=True)
class Method:
    service: str      # "orchestrator", "draft" or "verifier": which address
    path: str         # /package.Service/Method
    streaming: bool   # server-streaming reply
    request: type     # the request message class


METHODS = [
    Method("orchestrator", "/specmesh.v1.Orchestrator/Generate", True, orchestrator_pb2.GenerateRequest),
    Method("orchestrator", "/specmesh.v1.Orchestrator/GenerateUnary", False, orchestrator_pb2.GenerateRequest),
    Method("orchestrator", "/specmesh.v1.Orchestrator/Cancel", False, orchestrator_pb2.CancelRequest),
    Method("draft", "/specmesh.v1.Draft/Propose", False, draft_pb2.ProposeRequest),
    Method("draft", "/specmesh.v1.Draft/Release", False, cache_pb2.ReleaseRequest),
    Method("draft", "/specmesh.v1.Draft/Info", False, cache_pb2.InfoRequest),
    Method("verifier", "/specmesh.v1.Verifier/Prefill", False, verifier_pb2.PrefillRequest),
    Method("verifier", "/specmesh.v1.Verifier/Verify", False, verifier_pb2.VerifyRequest),
    Method("verifier", "/specmesh.v1.Verifier/Release", False, cache_pb2.ReleaseRequest),
    Method("verifier", "/specmesh.v1.Verifier/Info", False, cache_pb2.InfoRequest),
]
_BY_PATH = {m.path: m for m in METHODS}


@dataclass(frozen=True)
class Call:
    family: str       # what kind of case, for the report
    method: Method
    payload: bytes    # the serialized request as sent


@dataclass(frozen=True)
class Model:
    """What the strategies need to know of the target to reach past the first check."""

    vocab_size: int
    max_context: int


# ---------------------------------------------------------------- field values

def mostly(sane: st.SearchStrategy, wild: st.SearchStrategy, odds: int = 7) -> st.SearchStrategy:
    """`odds` times in `odds` + 1 a value that passes the field's check, so that a request with
    several fields gets past its first check to the code behind it; else anything the field's
    type allows. (Not one_of(sane, sane, sane, wild): hypothesis flattens nested one_ofs, which
    would weigh each branch of `wild` like one of `sane`.)"""
    return st.integers(0, odds).flatmap(lambda draw: wild if draw == 0 else sane)


# A few ids reused across requests, so a Verify, a Propose with start > 0 or a Release meets
# a session an earlier request created.
SESSION_POOL = ["fuzz-1", "fuzz-2", "fuzz:3"]


def session_ids() -> st.SearchStrategy[str]:
    valid = st.one_of(st.sampled_from(SESSION_POOL),
                      st.from_regex(r"[A-Za-z0-9._:-]{1,%d}" % MAX_SESSION_ID_CHARS, fullmatch=True))
    wild = st.one_of(st.just(""), st.text(max_size=40),
                     st.text(min_size=MAX_SESSION_ID_CHARS + 1, max_size=MAX_SESSION_ID_CHARS + 40),
                     st.builds(lambda c, n: c * n, st.sampled_from(["a", "\n", "a\nINFO forged"]),
                               st.integers(0, 5000)))
    return mostly(valid, wild)


def texts() -> st.SearchStrategy[str]:
    return st.one_of(st.text(alphabet="abc .\n", min_size=1, max_size=64), st.text(max_size=64))


def token_ids(model: Model) -> st.SearchStrategy[list[int]]:
    """Mostly in the vocabulary and short, sometimes out of it, sometimes beyond the context
    (never a long prefill: that measures the model, not the checks)."""
    in_vocab = st.integers(0, model.vocab_size - 1)
    return mostly(st.lists(in_vocab, min_size=1, max_size=48), st.one_of(
        st.lists(st.one_of(in_vocab, INT32), max_size=16),
        st.builds(lambda n, t: [t] * n, st.integers(model.max_context + 1, model.max_context + 64), in_vocab)))


def sampling_params() -> st.SearchStrategy[sampling_pb2.SamplingParams]:
    @st.composite
    def build(draw):
        msg = sampling_pb2.SamplingParams(
            temperature=draw(mostly(st.one_of(st.just(0.0), UNIT, st.sampled_from([1e-40, 1e-45, 1e-8, 3e38])),
                                    FLOAT32)),
            top_k=draw(mostly(st.integers(0, 100), INT32)))
        if draw(st.booleans()):
            msg.top_p = draw(mostly(st.floats(0, 1, width=32, exclude_min=True), FLOAT32))
        return msg

    return build()


def cache_syncs(model: Model) -> st.SearchStrategy[cache_pb2.CacheSync]:
    return st.builds(lambda start, ids: cache_pb2.CacheSync(start=start, token_ids=ids),
                     mostly(st.one_of(st.just(0), st.integers(0, 64)), INT64), token_ids(model))


def proposals(model: Model) -> st.SearchStrategy[draft_pb2.DraftProposal]:
    token = mostly(st.integers(0, model.vocab_size - 1), INT32)
    point_mass = token.map(lambda t: draft_pb2.DraftProposal(token_id=t, q_ids=[t], q_probs=[1.0]))

    @st.composite
    def spread(draw):   # a small q over distinct ids that holds the draft token, probabilities summing to 1
        ids = draw(st.lists(st.integers(0, model.vocab_size - 1), min_size=1, max_size=8, unique=True))
        weights = draw(st.lists(st.floats(0.01, 1), min_size=len(ids), max_size=len(ids)))
        return draft_pb2.DraftProposal(token_id=draw(st.sampled_from(ids)), q_ids=ids,
                                       q_probs=[w / sum(weights) for w in weights])

    anything = st.builds(lambda t, ids, probs: draft_pb2.DraftProposal(token_id=t, q_ids=ids, q_probs=probs),
                         token, st.lists(token, max_size=70), st.lists(FLOAT32, max_size=70))
    return mostly(st.one_of(point_mass, spread()), anything)


# ---------------------------------------------------------------- requests with random fields

def generate_requests(model: Model) -> st.SearchStrategy[orchestrator_pb2.GenerateRequest]:
    roles = mostly(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=12))

    @st.composite
    def build(draw):
        msg = orchestrator_pb2.GenerateRequest()
        prompt = draw(mostly(st.sampled_from(["text", "chat", "tokens"]), st.just("none")))
        if prompt == "text":
            msg.text = draw(texts())
        elif prompt == "chat":
            msg.chat.SetInParent()
            for role, content in draw(st.lists(st.tuples(roles, texts()), max_size=4, min_size=draw(mostly(
                    st.just(1), st.just(0))))):
                msg.chat.messages.add(role=role, content=content)
        elif prompt == "tokens":
            msg.tokens.SetInParent()
            msg.tokens.token_ids.extend(draw(token_ids(model)))
        # Never a long valid generation (it measures the model, not the checks, and outlasts the deadline).
        max_new = draw(mostly(st.one_of(st.none(), st.integers(1, 12)),
                              INT32.filter(lambda n: n <= 0 or n > model.max_context)))
        if max_new is not None:
            msg.max_new_tokens = max_new
        msg.sampling.CopyFrom(draw(sampling_params()))
        if draw(st.booleans()):
            msg.seed = draw(UINT64)
        msg.stop.extend(draw(mostly(st.lists(texts(), max_size=3), st.one_of(
            st.lists(st.text(max_size=300), max_size=40), st.lists(st.just("x"), min_size=17, max_size=40)))))
        k = draw(mostly(st.one_of(st.none(), st.integers(0, 8)), INT32))
        if k is not None:
            msg.k = k
        msg.drafter = draw(mostly(st.sampled_from(["", "ngram", "model"]), st.text(max_size=12)))
        msg.session_id = draw(st.one_of(st.just(""), session_ids()))
        return msg

    return build()


def propose_requests(model: Model) -> st.SearchStrategy[draft_pb2.ProposeRequest]:
    return st.builds(
        lambda sid, sync, k, drafter, sampling, seed_, top_n: draft_pb2.ProposeRequest(
            session_id=sid, sync=sync, k=k, drafter=drafter, sampling=sampling, seed=seed_, top_n=top_n),
        session_ids(), cache_syncs(model), mostly(st.integers(0, 8), INT32),
        mostly(st.sampled_from(["", "ngram", "model"]), st.text(max_size=12)), sampling_params(), UINT64,
        mostly(st.integers(0, 64), INT32))


def verify_requests(model: Model) -> st.SearchStrategy[verifier_pb2.VerifyRequest]:
    return st.builds(
        lambda sid, sync, props, sampling, seed_: verifier_pb2.VerifyRequest(
            session_id=sid, sync=sync, proposals=props, sampling=sampling, seed=seed_),
        session_ids(), cache_syncs(model), st.lists(proposals(model), max_size=10), sampling_params(), UINT64)


def prefill_requests(model: Model) -> st.SearchStrategy[verifier_pb2.PrefillRequest]:
    return st.builds(lambda sid, ids: verifier_pb2.PrefillRequest(session_id=sid, token_ids=ids),
                     session_ids(), token_ids(model))


def field_calls(model: Model) -> st.SearchStrategy[Call]:
    """A request of any method with random field values."""
    def call(path: str, family: str):
        return lambda msg: Call(family, _BY_PATH[path], msg.SerializeToString())

    release = st.builds(lambda sid: cache_pb2.ReleaseRequest(session_id=sid), session_ids())
    return st.one_of(
        generate_requests(model).map(call("/specmesh.v1.Orchestrator/Generate", "fields:Generate")),
        generate_requests(model).map(call("/specmesh.v1.Orchestrator/GenerateUnary", "fields:GenerateUnary")),
        st.builds(lambda sid: orchestrator_pb2.CancelRequest(session_id=sid), session_ids()).map(
            call("/specmesh.v1.Orchestrator/Cancel", "fields:Cancel")),
        propose_requests(model).map(call("/specmesh.v1.Draft/Propose", "fields:Propose")),
        propose_requests(model).map(call("/specmesh.v1.Draft/Propose", "fields:Propose")),
        verify_requests(model).map(call("/specmesh.v1.Verifier/Verify", "fields:Verify")),
        verify_requests(model).map(call("/specmesh.v1.Verifier/Verify", "fields:Verify")),
        prefill_requests(model).map(call("/specmesh.v1.Verifier/Prefill", "fields:Prefill")),
        release.map(call("/specmesh.v1.Draft/Release", "fields:Release")),
        release.map(call("/specmesh.v1.Verifier/Release", "fields:Release")),
    )


# ---------------------------------------------------------------- bytes

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string_fields(request: type) -> list[int]:
    """Field numbers of the message's own string fields (where invalid UTF-8 is a decode error)."""
    return [f.number for f in request.DESCRIPTOR.fields if f.type == f.TYPE_STRING] or [1]


def raw_calls(model: Model) -> st.SearchStrategy[Call]:
    """Bytes that are not, or only almost, a valid request, sent to any method."""
    methods = st.sampled_from(METHODS)
    valid = {
        orchestrator_pb2.GenerateRequest: generate_requests(model), draft_pb2.ProposeRequest: propose_requests(model),
        verifier_pb2.VerifyRequest: verify_requests(model), verifier_pb2.PrefillRequest: prefill_requests(model),
    }

    def valid_bytes(method: Method):
        strategy = valid.get(method.request, session_ids().map(lambda sid: _with_session(method.request, sid)))
        return strategy.map(lambda msg: msg.SerializeToString())

    @st.composite
    def build(draw):
        method = draw(methods)
        how = draw(st.sampled_from(["random", "flipped", "cut", "raw string"]))
        if how == "random":
            payload = draw(st.binary(max_size=256))
        else:
            payload = bytearray(draw(valid_bytes(method)))
            if how == "flipped" and payload:
                for _ in range(draw(st.integers(1, 4))):
                    payload[draw(st.integers(0, len(payload) - 1))] = draw(st.integers(0, 255))
            elif how == "cut" and payload:
                payload = payload[:draw(st.integers(0, len(payload) - 1))]
            elif how == "raw string":   # a string field holding arbitrary bytes, e.g. b"\xff\xfe" or a lone surrogate
                number = draw(st.sampled_from(_string_fields(method.request)))
                data = draw(st.one_of(st.binary(min_size=1, max_size=16), st.sampled_from(
                    [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\n\xe2\x82", b"\xf4\x90\x80\x80"])))
                payload += _varint(number << 3 | 2) + _varint(len(data)) + data
        return Call(f"bytes:{how}", method, bytes(payload))

    return build()


def _with_session(request: type, session_id: str):
    return request(session_id=session_id) if "session_id" in request.DESCRIPTOR.fields_by_name else request()


def calls(model: Model) -> st.SearchStrategy[Call]:
    """The mix the report counts: a third bytes, two thirds fields. (A plain one_of of the two
    would flatten field_calls' branches into it and leave bytes one case in eleven.)"""
    raw, fields = raw_calls(model), field_calls(model)
    return st.sampled_from(["bytes", "fields", "fields"]).flatmap(lambda kind: raw if kind == "bytes" else fields)


# ---------------------------------------------------------------- sending

@dataclass
class Target:
    orchestrator: str
    draft: str
    verifier: str


class Sender:
    """One raw channel per service; requests go out as the bytes they are (identity serializers)."""

    def __init__(self, target: Target, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.channels = {name: grpc.insecure_channel(getattr(target, name)) for name in ("orchestrator", "draft",
                                                                                          "verifier")}

    def send(self, call: Call) -> grpc.StatusCode:
        channel = self.channels[call.method.service]
        try:
            if call.method.streaming:
                for _ in channel.unary_stream(call.method.path)(call.payload, timeout=self.timeout_s):
                    pass
            else:
                channel.unary_unary(call.method.path)(call.payload, timeout=self.timeout_s)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def model_of(target: Target) -> Model:
    with grpc.insecure_channel(target.verifier) as channel:
        info = verifier_pb2_grpc.VerifierStub(channel).Info(cache_pb2.InfoRequest(), timeout=30)
    return Model(info.vocab_size, info.max_context)


SERVICES = {"orchestrator": "specmesh.v1.Orchestrator", "draft": "specmesh.v1.Draft",
            "verifier": "specmesh.v1.Verifier"}


def not_serving(target: Target) -> list[str]:
    """The services whose health is not SERVING (or that do not answer)."""
    bad = []
    for name, service in SERVICES.items():
        try:
            with grpc.insecure_channel(getattr(target, name)) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=10).status
        except grpc.RpcError as error:
            bad.append(f"{name}: {error.code().name}")
            continue
        if status != health_pb2.HealthCheckResponse.SERVING:
            bad.append(f"{name}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")
    return bad


def greedy_reference(target: Target) -> list[int]:
    """A plain greedy request through the whole stack: the same before and after the fuzz."""
    from specmesh.client import Client

    with Client(target.orchestrator) as client:
        return client.generate("the cat sat on the", max_new_tokens=12, k=3, timeout=120).token_ids


def run(target: Target, requests: int, seed_value: int, progress=None) -> collections.Counter:
    """Send `requests` generated calls; count (family, status name)."""
    sender, model = Sender(target), model_of(target)
    counts: collections.Counter = collections.Counter()

    @seed(seed_value)
    @settings(max_examples=requests, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(call=calls(model))
    def one(call: Call) -> None:
        counts[call.family, sender.send(call).name] += 1
        if progress is not None:
            progress(sum(counts.values()))

    try:
        one()
    finally:
        sender.close()
    return counts


def report(counts: collections.Counter) -> str:
    by_status = collections.Counter()
    by_family: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (family, status), n in counts.items():
        by_status[status] += n
        by_family[family][status] += n
    lines = [f"{sum(counts.values())} requests; by status:"]
    lines += [f"  {status:<20} {n:>5}" for status, n in by_status.most_common()]
    lines.append("by kind of request:")
    for family in sorted(by_family):
        lines.append(f"  {family:<22} " + ", ".join(f"{s} {n}" for s, n in by_family[family].most_common()))
    return "\n".join(lines)


def improper(counts: collections.Counter) -> int:
    return sum(n for (_, status), n in counts.items() if grpc.StatusCode[status] not in PROPER)


def _start_stack(model: str | None, log_dir: Path):
    from specmesh_cli.launcher import Cluster
    from specmesh_cli.ports import free_port

    # Short default generations: a valid random request should cost a moment, not a paragraph.
    return Cluster(model=model, port=free_port(), log_dir=log_dir, draft_replicas=1, verifier_replicas=1,
                   orchestrator_args=["--default-max-new-tokens", "16"]).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="the same seed sends the same requests")
    parser.add_argument("--model", default=None, help="target for the stack started here (default: smollm2)")
    parser.add_argument("--orchestrator",
                        help="fuzz a running stack: orchestrator host:port (with --draft and --verifier)")
    parser.add_argument("--draft")
    parser.add_argument("--verifier")
    args = parser.parse_args(argv)
    cluster = None
    if args.orchestrator:
        if not (args.draft and args.verifier):
            parser.error("--orchestrator needs --draft and --verifier too")
        target = Target(args.orchestrator, args.draft, args.verifier)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="specmesh-fuzz-"))
        print(f"starting a stack (logs in {log_dir}) ...", flush=True)
        cluster = _start_stack(args.model, log_dir)
        target = Target(cluster.address, f"localhost:{cluster.draft_port}", f"localhost:{cluster.verifier_port}")
    try:
        before = greedy_reference(target)
        started = time.monotonic()

        def progress(done: int) -> None:
            if done % 100 == 0:
                print(f"  {done} requests, {time.monotonic() - started:.0f} s", flush=True)

        counts = run(target, args.requests, args.seed, progress)
        print(report(counts))
        down = not_serving(target)
        same = greedy_reference(target) == before
        bad = improper(counts)
        print(f"improper statuses (UNKNOWN, INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED, ...): {bad}")
        print(f"every service SERVING afterwards: {'yes' if not down else 'no: ' + ', '.join(down)}")
        print(f"greedy reference request unchanged afterwards: {'yes' if same else 'no'}")
        print(f"wall time: {time.monotonic() - started:.0f} s")
        return 0 if not bad and not down and same else 1
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
