"""`specmesh soak --chaos` end to end on tiny models: processes are killed while
seeded streams run, and every output still equals its undisturbed twin."""
from __future__ import annotations

import json

import pytest

from specmesh_cli import cli

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)


def test_a_tiny_soak_under_chaos_keeps_every_output(tiny_models, tmp_path):
    code = cli.main(["soak", "--model", str(tiny_models["target"]), "--draft-model", str(tiny_models["draft"]),
                     "--prompts", "generated", "--streams", "32", "--concurrency", "4", "--unique", "8",
                     "--twin-concurrency", "4", "--drafter", "model", "--k", "3", "--chaos", "--chaos-every-s", "1.5", "--chaos-kills", "3",
                     "--settle-s", "0.5", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "soak.json").read_text())
    outputs, load = report["outputs"], report["load"]
    assert outputs["differ"] == [] and outputs["unchecked"] == []
    assert set(load["errors"]) <= {"UNAVAILABLE"}
    assert code == 0
    assert outputs["equal"] == outputs["completed"] >= 32 // 2   # most streams ride the kills out
    # The tiers take turns: three kills take one process of every tier, and each came back. The kills come
    # 1.5 s apart from the load's start; 32 streams keep the load going for half a minute here, long past
    # the third (with 16 and no cap on kills, one run ended after two).
    assert {k["process"].partition("-")[0] for k in report["kills"]} == {"draft", "verifier", "orchestrator"}
    assert len(report["kills"]) == 3   # --chaos-kills: no more once three are done
    assert all(count == 0 for count in report["cached_sessions_after"].values())
    assert {m["process"] for m in report["memory"]} == {"draft-0", "draft-1", "verifier-0", "verifier-1",
                                                        "orchestrator", "orchestrator-1"}
    assert all(m["after_mb"] for m in report["memory"])   # every process runs again, and was measured
    assert len(report["twins"]) == 8 and (tmp_path / "soak.png").stat().st_size > 0
