"""A distilled draft: a small causal LM over a subset of its target's vocabulary.

Folder layout (what `specmesh distill` writes and `--draft-model` loads):

    config.json          an ordinary transformers config; vocab_size = the draft's own vocabulary
    model.safetensors    the weights, float16 on disk (float32 in memory), or
    model.int8.safetensors  every matrix as int8 with one float16 scale per row (`--storage int8`:
                         half the size; dequantized to float32 at load)
    vocab_map.json       which target the draft belongs to and draft id -> target id
    README.md            the model card: data, steps, seed, wall time, measured acceptance

The draft's vocabulary is the target's most frequent output tokens (FR-Spec,
Zhao et al. 2025) plus one input-only "other" bucket that every remaining
target token maps to. Its output head covers only the subset, so a proposal q
is supported on those tokens; that is still a valid proposal and the
acceptance rule stays exact (a target token outside the subset is simply
never proposed, and comes back as a recovered or bonus token).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from specmesh.models import ModelInfo, ModelLoadError, VocabularyMismatch

VOCAB_MAP_FILE = "vocab_map.json"
FORMAT = "specmesh-distilled-draft/1"


@dataclass(frozen=True)
class VocabMap:
    target_name: str
    target_vocab_size: int
    target_fingerprint: str
    draft_to_target: tuple[int, ...]   # draft output id -> target id; the "other" input bucket is id len(...)
    eos_token_ids: tuple[int, ...]     # the target's, in target ids
    max_context: int

    @property
    def other_id(self) -> int:
        return len(self.draft_to_target)

    @property
    def draft_vocab_size(self) -> int:
        return len(self.draft_to_target) + 1

    def target_to_draft(self) -> torch.Tensor:
        """[target_vocab_size] int64: a target id's draft input id (the 'other' bucket when outside the subset)."""
        table = torch.full((self.target_vocab_size,), self.other_id, dtype=torch.long)
        table[torch.tensor(self.draft_to_target, dtype=torch.long)] = torch.arange(len(self.draft_to_target))
        return table

    def to_json(self) -> str:
        return json.dumps(dict(format=FORMAT, target_name=self.target_name, target_vocab_size=self.target_vocab_size,
                               target_fingerprint=self.target_fingerprint, eos_token_ids=list(self.eos_token_ids),
                               max_context=self.max_context, draft_to_target=list(self.draft_to_target)))

    @classmethod
    def read(cls, folder: Path) -> "VocabMap":
        path = folder / VOCAB_MAP_FILE
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
            vocab_map = cls(str(raw["target_name"]), int(raw["target_vocab_size"]), str(raw["target_fingerprint"]),
                            tuple(int(i) for i in raw["draft_to_target"]),
                            tuple(int(i) for i in raw["eos_token_ids"]), int(raw["max_context"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"draft folder {folder}: unreadable {VOCAB_MAP_FILE}: {err}") from err
        ids = vocab_map.draft_to_target
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_map.target_vocab_size:
            raise ModelLoadError(f"draft folder {folder}: {VOCAB_MAP_FILE} must list distinct target ids in "
                                 f"[0, {vocab_map.target_vocab_size})")
        return vocab_map


def is_distilled_draft(spec: str) -> bool:
    return (Path(spec).expanduser() / VOCAB_MAP_FILE).is_file()


def check_fits(vocab_map: VocabMap, draft_name: str, target: ModelInfo) -> None:
    """Raise VocabularyMismatch unless the map was made for a target with this vocabulary."""
    if (vocab_map.target_fingerprint, vocab_map.target_vocab_size) != (target.vocab_fingerprint, target.vocab_size):
        raise VocabularyMismatch(
            f"draft {draft_name!r} was distilled for target {vocab_map.target_name!r} (vocab "
            f"{vocab_map.target_vocab_size}, fingerprint {vocab_map.target_fingerprint}); its vocabulary map does not "
            f"fit target {target.name!r} (vocab {target.vocab_size}, fingerprint {target.vocab_fingerprint}). "
            "Distill a draft for this target with `specmesh distill --target ...`.")


@dataclass
class DistilledDraft:
    model: "torch.nn.Module"
    vocab_map: VocabMap
    info: ModelInfo                 # speaks for the target's vocabulary: what the orchestrator compares
    target_to_draft: torch.Tensor   # [target_vocab_size] int64
    draft_to_target: torch.Tensor   # [n_out] int64


def load_draft(spec: str, *, device: str = "cpu", target: ModelInfo | None = None) -> DistilledDraft:
    """Load a distilled draft folder; with `target`, refuse one whose vocabulary map does not fit it."""
    from transformers import AutoModelForCausalLM

    folder = Path(spec).expanduser().resolve()
    vocab_map = VocabMap.read(folder)
    if target is not None:
        check_fits(vocab_map, str(folder), target)
    try:
        if (folder / INT8_FILE).is_file():
            model = _load_int8(folder)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - any unreadable folder is one clear error
        raise ModelLoadError(f"could not load draft folder {folder}: {err}") from err
    rows = model.get_output_embeddings().weight.shape[0]
    if rows != vocab_map.draft_vocab_size:
        raise ModelLoadError(f"draft folder {folder}: the model has {rows} output rows but {VOCAB_MAP_FILE} "
                             f"maps {vocab_map.draft_vocab_size} draft ids")
    model.to(device).eval().requires_grad_(False)
    info = ModelInfo(name=str(folder), vocab_size=vocab_map.target_vocab_size,
                     vocab_fingerprint=vocab_map.target_fingerprint, max_context=vocab_map.max_context,
                     eos_token_ids=vocab_map.eos_token_ids)
    return DistilledDraft(model, vocab_map, info, vocab_map.target_to_draft().to(device),
                          torch.tensor(vocab_map.draft_to_target, dtype=torch.long, device=device))


def save_draft(folder: Path, model, vocab_map: VocabMap, card: str, extra: dict | None = None,
               storage: str = "float16") -> None:
    """Write the folder (float16 or int8 weights: the draft only proposes, and the folder ships)."""
    folder.mkdir(parents=True, exist_ok=True)
    if storage == "int8":
        _save_int8(folder, model)
    else:
        half = model.to(torch.float16)
        try:
            half.save_pretrained(folder)
        finally:
            model.to(torch.float32)
    (folder / VOCAB_MAP_FILE).write_text(vocab_map.to_json())
    (folder / "README.md").write_text(card)
    if extra is not None:
        (folder / "distill.json").write_text(json.dumps(extra, indent=1))
    for f in folder.iterdir():
        f.chmod(0o644)      # safetensors writes owner-only files; the folder ships to every user


def cut_head(lm, n: int) -> bool:
    """Let a distilled draft's LM propose among the first n ids of its vocabulary only (FR-Spec).

    The vocabulary is in order of frequency in the target's answers, so those are its n most
    frequent tokens. A draft token reads every row of the output head: for the shipped drafts the head
    is most of a token's memory traffic, and a lone row on a CPU is bound by that traffic. Inputs keep
    the whole vocabulary (the embedding is a lookup); the head keeps its last row, the input-only
    "other" bucket, so mask_other still drops it. A q supported on fewer tokens is still a valid
    proposal: only acceptance moves. Returns whether the head was cut (n <= 0 or n >= its size: no).
    """
    head = lm.get_output_embeddings()
    n_out = head.weight.shape[0] - 1
    if n <= 0 or n >= n_out:
        return False
    with torch.no_grad():
        rows = torch.cat([head.weight[:n], head.weight[-1:]]).detach().clone()            # [n + 1, H]
    cut = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    cut.weight = torch.nn.Parameter(rows, requires_grad=False)
    lm.set_output_embeddings(cut)
    return True


def mask_other(logits: torch.Tensor) -> torch.Tensor:
    """[..., n_out + 1] draft logits -> [..., n_out]: the 'other' bucket is an input, never a proposal."""
    return logits[..., :-1]


def to_target_ids(draft_to_target: torch.Tensor, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return draft_to_target[torch.as_tensor(ids, dtype=torch.long, device=draft_to_target.device)]


INT8_FILE = "model.int8.safetensors"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float -> ([R, C] int8, [R, 1] float16 scale): symmetric, one scale per row."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-8).to(torch.float16)
    q = torch.round(weight.float() / scale.float()).clamp(-127, 127).to(torch.int8)
    return q, scale


def fake_quantize(model) -> None:
    """Round every matrix in place as int8 storage would (so measured acceptance is the shipped one)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                q, scale = quantize_rows(param)
                param.copy_(q.float() * scale.float())


def _save_int8(folder: Path, model) -> None:
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue                      # the same matrix as the input embedding
        if value.dim() == 2:
            tensors[name], tensors[name + ".scale"] = quantize_rows(value)
        else:
            tensors[name] = value.to(torch.float16)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / INT8_FILE), metadata={"format": "pt"})


def _load_int8(folder: Path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    raw = load_file(str(folder / INT8_FILE))
    state = {name: (value.float() * raw[name + ".scale"].float() if name + ".scale" in raw else value.float())
             for name, value in raw.items() if not name.endswith(".scale")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"weights do not match the config (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    return model
