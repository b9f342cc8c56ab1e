"""A hypothesis fuzz at the byte and the field level against live services.

Random bytes as the serialized request of every method, and requests with random
field values on the public GenerateRequest and the internal Propose, Verify and
Prefill requests: only proper statuses (never UNKNOWN, INTERNAL, UNAVAILABLE or a
hang), and afterwards every service is SERVING and a greedy request gives what it
gave before. A few dozen examples each here; `python -m tools.fuzz` runs 1,000
for a report.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from tools import fuzz

EXAMPLES = 40
# derandomize: the same examples every run, so CI is not a lottery (python -m tools.fuzz draws fresh ones)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzzed(tiny_models, redis_url, tmp_path_factory):
    """Its own stack: what the fuzz leaves in caches never reaches another test's assertions."""
    cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                      redis_url=redis_url, log_dir=tmp_path_factory.mktemp("logs-fuzz"),
                      orchestrator_args=["--default-max-new-tokens", "16"])
    with cluster:
        target = fuzz.Target(cluster.address, f"localhost:{cluster.draft_port}", f"localhost:{cluster.verifier_port}")
        sender = fuzz.Sender(target, timeout_s=60)
        yield target, sender, fuzz.model_of(target), fuzz.greedy_reference(target)
        sender.close()


def _fuzz(fuzzed, strategy_of) -> None:
    target, sender, model, reference = fuzzed
    seen = []

    @FUZZ
    @given(data=st.data())
    def one(data):
        call = data.draw(strategy_of(model), label="call")
        status = sender.send(call)
        seen.append(status)
        assert status in fuzz.PROPER, f"{call.method.path} answered {status.name} to {call.payload[:200]!r}"

    one()
    assert fuzz.not_serving(target) == []
    assert fuzz.greedy_reference(target) == reference
    assert len(set(seen)) > 1, "every request got the same status: the fuzz reached no further than one check"


def test_random_and_corrupted_bytes_on_every_method(fuzzed):
    _fuzz(fuzzed, fuzz.raw_calls)


def test_random_generate_requests(fuzzed):
    _fuzz(fuzzed, lambda model: fuzz.generate_requests(model).map(
        lambda msg: fuzz.Call("fields:Generate", fuzz.METHODS[0], msg.SerializeToString())))


def test_random_internal_requests(fuzzed):
    _fuzz(fuzzed, lambda model: st.one_of(
        fuzz.propose_requests(model).map(lambda m: fuzz.Call("Propose", fuzz._BY_PATH["/specmesh.v1.Draft/Propose"],
                                                              m.SerializeToString())),
        fuzz.verify_requests(model).map(lambda m: fuzz.Call("Verify", fuzz._BY_PATH["/specmesh.v1.Verifier/Verify"],
                                                             m.SerializeToString())),
        fuzz.prefill_requests(model).map(lambda m: fuzz.Call("Prefill",
                                                              fuzz._BY_PATH["/specmesh.v1.Verifier/Prefill"],
                                                              m.SerializeToString()))))
