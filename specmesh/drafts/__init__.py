"""Draft models that ship with specmesh, and the names that select them.

    smollm2-draft   distilled for the default target (SmolLM2-135M-Instruct) by `specmesh distill`;
                    see smollm2-135m-draft/README.md for how, and its measured acceptance
    smollm2-eagle   an EAGLE draft (specmesh.eagle) for the same target, served as the `eagle` drafter
                    once its folder holds a vocabulary map (`specmesh distill --arch eagle`)

`specmesh up` (the launcher) serves it next to n-gram when the target is the
default and no --draft-model is given; anywhere else name it explicitly
(`--draft-model smollm2-draft`, SPECMESH_DRAFT_MODEL=smollm2-draft).
"""
from __future__ import annotations

import os
from pathlib import Path

from specmesh.models import DEFAULT_MODEL

HERE = Path(__file__).resolve().parent
SHIPPED = {"smollm2-draft": HERE / "smollm2-135m-draft", "smollm2-eagle": HERE / "smollm2-135m-eagle"}
# The shipped draft each target gets when none is named.
DEFAULT_DRAFTS = {DEFAULT_MODEL: "smollm2-draft"}
# The shipped EAGLE draft (the `eagle` drafter, specmesh.eagle) each target gets when none is named.
DEFAULT_EAGLES = {DEFAULT_MODEL: "smollm2-eagle"}
# Which drafter answers requests that name none while a shipped draft is served, by measurement
# (`specmesh bench --per-category 2 --peers hf`, docs/distill.md). With the EAGLE draft served,
# `eagle-hybrid` (prompt lookup on a 3-token match, EAGLE elsewhere): 1.62x over target-only at k = 4
# against n-gram's 1.36x, ahead of n-gram in 12 of 13 categories. With only the plain distilled
# draft, n-gram: the plain draft commits 1.1-1.3 tokens per step at ~30 ms a draft token, and every
# request type measured ran faster with n-gram.
SHIPPED_DEFAULT_DRAFTER = {"smollm2-eagle": "eagle-hybrid", "smollm2-draft": "ngram"}


def resolve_draft(spec: str) -> str:
    """A shipped draft's name -> its folder; anything else unchanged."""
    folder = SHIPPED.get(spec.strip().lower())
    return str(folder) if folder is not None else spec


def default_draft(target: str | None) -> str | None:
    """The shipped draft served for `target` when no draft model is named (None: n-gram only)."""
    name = DEFAULT_DRAFTS.get((target or DEFAULT_MODEL).strip().lower())
    if name is None or not (SHIPPED[name] / "vocab_map.json").is_file():
        return None
    return name


def default_eagle(target: str | None) -> str | None:
    """The shipped EAGLE draft served for `target` when none is named (None: no `eagle` drafter)."""
    name = DEFAULT_EAGLES.get((target or DEFAULT_MODEL).strip().lower())
    if name is None or not (SHIPPED[name] / "vocab_map.json").is_file():
        return None
    return name


def eagle_for(target: str | None, named: str | None) -> str | None:
    """What `specmesh up` serves as the `eagle` drafter: the one named, none for 'none', else the target's shipped one."""
    named = named or os.environ.get("SPECMESH_EAGLE_MODEL")
    if named:
        return None if named.strip().lower() == "none" else named
    return default_eagle(target or os.environ.get("SPECMESH_MODEL"))


def draft_for(target: str | None, named: str | None) -> str | None:
    """What `specmesh up` / `bench` serve: the draft named, none for 'none', else the target's shipped one."""
    named = named or os.environ.get("SPECMESH_DRAFT_MODEL")
    if named:
        return None if named.strip().lower() == "none" else named
    return default_draft(target or os.environ.get("SPECMESH_MODEL"))


def default_drafter(drafts: tuple[str | None, ...], served: set[str]) -> str:
    """The drafter for requests that name none: the measured choice of the first draft in `drafts`
    (the tier's EAGLE and plain draft models, in that order) whose choice is served, else the model
    when one is served, else n-gram. A shipped draft's choice is in SHIPPED_DEFAULT_DRAFTER; an EAGLE
    draft of the user's own (`specmesh distill --arch eagle`, `--init-from smollm2-eagle`) is the
    shipped one's architecture, served by the same drafters, so it gets the same choice: before
    this, serving one left every request on n-gram unless it named `eagle-hybrid`."""
    from specmesh.eagle import is_eagle_draft

    for draft in drafts:
        name = (draft or "").strip().lower()
        shipped = SHIPPED_DEFAULT_DRAFTER.get(name)
        if shipped is None and name not in ("", "none") and is_eagle_draft(resolve_draft(draft)):
            shipped = SHIPPED_DEFAULT_DRAFTER["smollm2-eagle"]
        if shipped in served:
            return shipped
    return "model" if "model" in served else "ngram"
