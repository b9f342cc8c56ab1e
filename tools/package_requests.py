"""A `--prompts-file` for a domain none of distill's data sources covers: an ops assistant asked about the
Debian packages installed on this machine, built from their own descriptions (/var/lib/dpkg/status).
docs/distill.md, "The shipped draft fitted to an ops assistant's requests", ran on its output:

    python -m tools.package_requests --out requests.jsonl

Three categories, a third each: `package-notes` (a long description to explain), `package-questions`
(a short question about a package by name), `ops-chat` (a three-turn OpenAI `messages` conversation).
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ASKS = ("What does the Debian package {n} do, and when would I install it?",
        "Explain what {n} is for, in two or three sentences.",
        "Is {n} something a web server needs? Answer briefly and say why.",
        "Write the command that installs {n} on Debian and say what it provides.",
        "My colleague installed {n} ({s}). What is it used for?")


def packages(status: Path) -> list[tuple[str, str, str]]:
    """(name, one-line summary, long description) of each package in a dpkg status file."""
    out = []
    for block in status.read_text().split("\n\n"):
        name = re.search(r"^Package: (.+)$", block, re.M)
        desc = re.search(r"^Description: (.+)\n((?: .*\n?)*)", block, re.M)
        if name and desc:
            body = " ".join(line.strip() for line in desc.group(2).splitlines() if line.strip() not in ("", "."))
            out.append((name.group(1), desc.group(1).strip(), body))
    return out


def requests(pkgs: list[tuple[str, str, str]], seed: int) -> list[dict]:
    rng = random.Random(seed)
    pkgs = list(pkgs)
    rng.shuffle(pkgs)
    rows = []
    for i, (name, summary, body) in enumerate(pkgs):
        if i % 3 == 0 and body:
            rows.append({"category": "package-notes", "prompt": f"Here is a software package's description:\n\n"
                         f"{body[:900]}\n\nExplain in plain words what this software is for and who needs it."})
        elif i % 3 == 1:
            rows.append({"category": "package-questions", "prompt": rng.choice(ASKS).format(n=name, s=summary)})
        else:
            rows.append({"category": "ops-chat", "messages": [
                {"role": "user", "content": "I'm cleaning up packages on a small server."},
                {"role": "assistant", "content": "Sure. Tell me which package you are unsure about and I'll explain "
                                                 "what it does."},
                {"role": "user", "content": f"What about {name}? The description says: {summary}. Can I remove it?"}]})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.package_requests", description=__doc__.splitlines()[0])
    p.add_argument("--status", type=Path, default=Path("/var/lib/dpkg/status"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rows = requests(packages(args.status), args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} requests to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
