"""The README's first command ends in `specmesh up`, which streams one answer through the whole stack
before it serves; `specmesh demo` is the same and exits after that answer. Both run the same code."""
from __future__ import annotations

import subprocess
import sys

from specmesh_cli.ports import free_port


def test_specmesh_demo_streams_its_first_answer_through_every_service_and_exits(tiny_models, redis_url):
    run = subprocess.run(
        [sys.executable, "-m", "specmesh_cli.cli", "demo", "--model", str(tiny_models["target"]),
         "--draft-model", str(tiny_models["draft"]), "--eagle-model", "none", "--redis-url", redis_url,
         "--port", str(free_port()), "--http-port", "0", "--prompt", "abc abc abc", "--max-new-tokens", "12"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "> abc abc abc" in run.stdout
    assert "tokens/s, finish:" in run.stdout        # the stats line after the streamed answer
    assert "committed tokens per step" in run.stdout
