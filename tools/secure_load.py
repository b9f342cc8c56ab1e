"""What the locked door costs: the same load on a plain stack and on one with TLS everywhere, mutual TLS
between the tiers, bearer tokens on the public API and an internal token.

    python -m tools.secure_load                       # default model, 2 rounds, 64 streams at 16 at a time
    python -m tools.secure_load --rounds 1 --streams 32

Each round starts a plain stack, runs `specmesh soak` against it (no chaos), stops it, then does the same
with a sealed stack (certificates from a throwaway CA made with trustme, a dev dependency), so the two
alternate and share the machine's mood. Prints tokens/s and time to first token per run, and the
sealed/plain ratio of tokens/s over all rounds.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from specmesh.drafts import draft_for
from specmesh.tls import ChannelTLS
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from specmesh_cli.redis_server import EmbeddedRedis
from tools.dev_pki import write_pki

TOKEN, INTERNAL = "load-test-token-5d1e", "internal-token-8c2f"


def soak(cluster: Cluster, out: Path, args, secure: ChannelTLS | None, root: Path) -> dict:
    command = [sys.executable, "-m", "specmesh_cli.cli", "soak", "--addr", cluster.address, "--out", str(out),
               "--streams", str(args.streams), "--concurrency", str(args.concurrency), "--unique", str(args.unique),
               "--twin-concurrency", str(args.concurrency), "--settle-s", "0"]
    if secure is not None:
        command += ["--tls-ca-file", secure.ca_file, "--token-file", str(root / "token")]
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
    report = json.loads((out / "soak.json").read_text())
    return report["load"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--unique", type=int, default=16)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="specmesh-secure-load-"))
    files = write_pki(root)
    (root / "tokens").write_text(TOKEN + "\n")
    (root / "token").write_text(TOKEN + "\n")
    (root / "internal").write_text(INTERNAL + "\n")
    runs = []
    for round_ in range(args.rounds):
        for name in ("plain", "sealed"):
            secure = files if name == "sealed" else None
            with EmbeddedRedis(tls=secure, password="redis-pw-load" if secure else None) as redis:
                cluster = Cluster(draft_model=draft_for(None, None), port=free_port(), redis_url=redis.url,
                                  log_dir=root / f"logs-{name}-{round_}", tls=secure,
                                  extra_env={"SPECMESH_INTERNAL_TOKEN_FILE": str(root / "internal")} if secure else {},
                                  orchestrator_args=["--auth-tokens-file", str(root / "tokens")] if secure else [])
                with cluster:
                    load = soak(cluster, root / f"soak-{name}-{round_}", args, secure, root)
            runs.append({"round": round_, "stack": name, **load})
            print(f"round {round_ + 1} {name:6s}: {load['tokens_per_second']:.1f} tokens/s, TTFT p50 "
                  f"{load['ttft_p50_s']:.3f} s, p99 {load['ttft_p99_s']:.3f} s, errors {load['errors']}", flush=True)
    plain = sum(r["tokens_per_second"] for r in runs if r["stack"] == "plain")
    sealed = sum(r["tokens_per_second"] for r in runs if r["stack"] == "sealed")
    print(f"sealed / plain tokens/s over {args.rounds} round(s): {sealed / plain:.3f}")
    (root / "secure_load.json").write_text(json.dumps(runs, indent=1))
    print(f"wrote {root / 'secure_load.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
