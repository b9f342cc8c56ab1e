"""Requests from a file of the user's own: a draft for the traffic it will serve.

A draft learns what the target answers to the requests it is trained on. The
templates and the target's self-written requests stand in for traffic nobody
has shown us; a team that has its own requests (logs of its chat service, a
ShareGPT-style export) gets a draft for them with `--prompts-file`.

Each line of the JSONL file is one request, in one of the shapes such data
come in:

    "a bare string"
    {"prompt": "..."}                                              completion-style
    {"messages": [{"role": "user", "content": "..."}, ...]}        OpenAI chat
    {"conversations": [{"from": "human", "value": "..."}, ...]}    ShareGPT (what EAGLE and Medusa train on)

and may name a "category" (default ``prompts-file``), which the model card
reports acceptance for. The target answers each conversation up to its last
user turn; earlier assistant turns stay as context. The file's own answers are
never trained on: a draft learns the target's answers, not somebody else's.

Duplicates and requests that meet a Spec-Bench question (distill.self_prompts.
BenchFilter) are left out and counted; a few requests of each category are
held out for the card's acceptance, so the card measures the draft on the
user's own kind of request.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from distill.prompts import Prompt

DEFAULT_CATEGORY = "prompts-file"
# ShareGPT names its speakers; these are the names its exports use.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bard": "assistant", "bing": "assistant", "system": "system"}
CHAT_ROLES = ("system", "user", "assistant")


class PromptsFileError(ValueError):
    """The file cannot be read as requests: the message names the file and the line."""


@dataclass
class PromptsFile:
    path: Path
    sha256: str
    train: list[Prompt]
    heldout: list[Prompt]
    lines: int                                          # requests read
    dropped: dict[str, int] = field(default_factory=dict)   # reason -> requests left out

    @property
    def folder_name(self) -> str:
        """Its data's folder in the work folder: a different file (or split) never reuses these answers."""
        return f"file-{self.sha256[:12]}"


def load(path: Path, heldout_per_category: int, seed: int, chat_template: bool,
         keep: Callable[[str], bool] = lambda text: True) -> PromptsFile:
    """Read, check and split `path`. `keep(text)`: False for a user turn that may not be trained on
    (a benchmark question). Held out: up to `heldout_per_category` requests of each category, never
    more than half of one, drawn with `seed`."""
    if not path.is_file():
        raise PromptsFileError(f"--prompts-file {path} does not exist or is not a file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise PromptsFileError(f"--prompts-file {path} is not UTF-8 text ({error.reason} at byte {error.start})")
    by_category: dict[str, list[Prompt]] = {}
    seen: set[tuple] = set()
    dropped = {"duplicate": 0, "matches a Spec-Bench question": 0}
    lines = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        lines += 1
        where = f"--prompts-file {path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptsFileError(f"{where}: not JSON ({error.msg}); each line is one request") from None
        prompt = _prompt(record, where, chat_template)
        if not all(keep(content) for role, content in prompt.messages if role == "user"):
            dropped["matches a Spec-Bench question"] += 1
            continue
        if (prompt.category, prompt.messages) in seen:
            dropped["duplicate"] += 1
            continue
        seen.add((prompt.category, prompt.messages))
        by_category.setdefault(prompt.category, []).append(prompt)
    if not by_category:
        left_out = ", ".join(f"{n} {reason}" for reason, n in dropped.items() if n)
        raise PromptsFileError(f"--prompts-file {path} holds no request to train on"
                               + (f" ({lines} read, left out: {left_out})" if lines else " (it is empty)"))
    rng = random.Random(seed)
    train, heldout = [], []
    for category in sorted(by_category):
        prompts = by_category[category]
        order = list(range(len(prompts)))
        rng.shuffle(order)
        n_heldout = min(heldout_per_category, len(prompts) // 2)
        held = set(order[:n_heldout])
        heldout += [p for i, p in enumerate(prompts) if i in held]
        train += [p for i, p in enumerate(prompts) if i not in held]
    return PromptsFile(path, hashlib.sha256(raw).hexdigest(), train, heldout, lines,
                       {reason: n for reason, n in dropped.items() if n})


def load_for_training(path: Path, heldout_per_category: int, seed: int, chat_template: bool) -> PromptsFile:
    """`load` with the Spec-Bench filter: what `specmesh distill --prompts-file` trains on and holds out.
    tools.heldout_questions calls it too, so its question file is exactly distill's held-out split."""
    from distill.self_prompts import BenchFilter
    from specmesh import spec_bench

    return load(path, heldout_per_category, seed, chat_template, BenchFilter(spec_bench.QUESTIONS))


def _prompt(record, where: str, chat_template: bool) -> Prompt:
    category = DEFAULT_CATEGORY
    if isinstance(record, dict):
        category = record.get("category", DEFAULT_CATEGORY)
        if not isinstance(category, str) or not category.strip():
            raise PromptsFileError(f"{where}: \"category\" must be a non-empty string")
        category = category.strip()
    if isinstance(record, str):
        messages = [("user", record)]
    elif isinstance(record, dict) and "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise PromptsFileError(f"{where}: \"prompt\" must be a string")
        messages = [("user", record["prompt"])]
    elif isinstance(record, dict) and "messages" in record:
        messages = _turns(record["messages"], "messages", "role", "content", {r: r for r in CHAT_ROLES}, where)
    elif isinstance(record, dict) and "conversations" in record:
        messages = _turns(record["conversations"], "conversations", "from", "value", SHAREGPT_ROLES, where)
    else:
        raise PromptsFileError(f"{where}: expected a string or an object with \"prompt\", \"messages\" (OpenAI chat) "
                               f"or \"conversations\" (ShareGPT)")
    # The target answers the last user turn; what followed it in the file is somebody else's answer.
    users = [i for i, (role, _) in enumerate(messages) if role == "user"]
    if not users:
        raise PromptsFileError(f"{where}: the conversation has no user turn to answer")
    messages = messages[:users[-1] + 1]
    if not messages[-1][1].strip():
        raise PromptsFileError(f"{where}: the last user turn is empty")
    if not chat_template and len(messages) > 1:
        raise PromptsFileError(f"{where}: a conversation of {len(messages)} turns needs a target with a chat template "
                               f"to render it, and this target has none (give such requests as one \"prompt\")")
    return Prompt(category, messages[-1][1], tuple(messages))


def _turns(turns, key: str, role_key: str, text_key: str, roles: dict[str, str], where: str) -> list[tuple[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise PromptsFileError(f"{where}: \"{key}\" must be a non-empty list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str):
            raise PromptsFileError(f"{where}: {key}[{i}] needs a string \"{text_key}\"")
        role = roles.get(str(turn.get(role_key, "")).lower())
        if role is None:
            raise PromptsFileError(f"{where}: {key}[{i}] has {role_key} {turn.get(role_key)!r}; expected one of "
                                   f"{', '.join(sorted(roles))}")
        out.append((role, turn[text_key]))
    return out
