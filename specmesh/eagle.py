"""An EAGLE-style draft: one decoder layer that continues the target's own features.

EAGLE (Li et al. 2024) drafts from the target's last hidden state instead of
from tokens alone. Here, at position j the draft reads the pair

    (token x_j, the target's feature f_{j-1} at the position before)

mixed by one linear layer (`fc`, 2H -> H) into the input of a small causal
decoder (the draft LM's layers and final norm). Its output h_j stands in for
f_j: the LM head turns it into the distribution of x_{j+1}, and while drafting
several tokens ahead, h_j is the feature fed with the next draft token.

A feature is what the target's LM head reads (the base model's last hidden
state, after its final norm). Committed positions always use the target's real
features, which travel verifier -> orchestrator -> draft (fp16, one row per
committed position); only the positions drafted in this step use the draft's
own. Position 0 has no feature before it and reads zeros.

On disk an EAGLE draft is a distilled draft folder (specmesh.distilled: the
draft LM over a subset of the target's vocabulary, its vocabulary map, the card)
plus `eagle.safetensors`, which holds `fc`. The draft's embedding and head are
the target's own rows for that subset.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specmesh.distilled import DistilledDraft, load_draft, quantize_rows
from specmesh.models import ModelInfo, ModelLoadError, cache_kwargs, custom_attention_mask

EAGLE_FILE = "eagle.safetensors"


def is_eagle_draft(spec: str) -> bool:
    return (Path(spec).expanduser() / EAGLE_FILE).is_file()


class EagleDraft(torch.nn.Module):
    """The draft LM (embedding, decoder layers, norm, tied head over the draft vocabulary) plus `fc`."""

    def __init__(self, lm, fc: torch.nn.Linear | None = None):
        super().__init__()
        self.lm = lm
        hidden = lm.config.get_text_config().hidden_size if hasattr(lm.config, "get_text_config") \
            else lm.config.hidden_size
        self.hidden_size = hidden
        self.fc = fc if fc is not None else torch.nn.Linear(2 * hidden, hidden, bias=True)
        # Set when serving (specmesh.lean_decoder): the decoder's forward with a cache, same bits, less overhead.
        self.lean = None

    @property
    def config(self):
        return self.lm.config

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def forward(self, input_ids: torch.Tensor, prev_features: torch.Tensor, cache=None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                logits_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] draft ids; prev_features [B, T, H], the feature before each position.

        Returns (logits [B, rows, n_out + 1] over the draft vocabulary for the last `logits_rows`
        positions (all when None), hidden [B, T, H]: the draft's stand-in for the target's features).
        """
        embeds = self.lm.get_input_embeddings()(input_ids)                               # [B, T, H]
        mixed = self.fc(torch.cat([embeds, prev_features.to(embeds.dtype)], dim=-1))      # [B, T, H]
        if self.lean is not None and cache is not None:
            hidden = self.lean(mixed, cache, attention_mask, position_ids)                # [B, T, H]
        else:
            kwargs = {} if cache is None else cache_kwargs(self.lm.model, cache)
            hidden = self.lm.model(inputs_embeds=mixed, attention_mask=attention_mask, position_ids=position_ids,
                                   **kwargs).last_hidden_state                            # [B, T, H]
        rows = hidden if logits_rows is None else hidden[:, -logits_rows:]
        return self.lm.lm_head(rows), hidden


def load_eagle(spec: str, *, device: str = "cpu", target: ModelInfo | None = None) -> DistilledDraft:
    """An EAGLE draft folder -> DistilledDraft whose model is an EagleDraft (refused when it does not fit `target`)."""
    from safetensors.torch import load_file

    folder = Path(spec).expanduser().resolve()
    draft = load_draft(str(folder), device="cpu", target=target)
    try:
        raw = load_file(str(folder / EAGLE_FILE))
        weight = raw["fc.weight"].float()
        if "fc.weight.scale" in raw:
            weight = weight * raw["fc.weight.scale"].float()
        hidden = weight.shape[0]
        fc = torch.nn.Linear(2 * hidden, hidden, bias="fc.bias" in raw)
        with torch.no_grad():
            fc.weight.copy_(weight)
            if "fc.bias" in raw:
                fc.bias.copy_(raw["fc.bias"].float())
    except Exception as err:  # noqa: BLE001 - any unreadable file is one clear error
        raise ModelLoadError(f"could not load EAGLE draft {folder}: {EAGLE_FILE}: {err}") from err
    model = EagleDraft(draft.model, fc)
    if fc.weight.shape != (model.hidden_size, 2 * model.hidden_size):
        raise ModelLoadError(f"EAGLE draft {folder}: fc is {tuple(fc.weight.shape)}, expected "
                             f"({model.hidden_size}, {2 * model.hidden_size}) for hidden size {model.hidden_size}")
    model.to(device).eval().requires_grad_(False)
    draft.model = model
    draft.target_to_draft = draft.target_to_draft.to(device)
    draft.draft_to_target = draft.draft_to_target.to(device)
    return draft


def save_fc(folder: Path, model: EagleDraft, storage: str = "float16") -> None:
    """Write `fc` beside the draft LM (save_draft writes the LM, the map and the card)."""
    from safetensors.torch import save_file

    weight = model.fc.weight.detach().cpu()
    if storage == "int8":
        q, scale = quantize_rows(weight)
        tensors = {"fc.weight": q, "fc.weight.scale": scale}
    else:
        tensors = {"fc.weight": weight.to(torch.float16)}
    if model.fc.bias is not None:
        tensors["fc.bias"] = model.fc.bias.detach().cpu().to(torch.float16)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / EAGLE_FILE), metadata={"format": "pt"})
    (folder / EAGLE_FILE).chmod(0o644)


def features_to_bytes(features: torch.Tensor) -> bytes:
    """[N, H] float -> N * H little-endian float16 values (the wire and Redis format)."""
    return features.detach().to("cpu", torch.float16).contiguous().numpy().tobytes()


def features_from_bytes(data: bytes, hidden: int) -> torch.Tensor:
    """The inverse: -> [N, H] float32. ValueError when the length is not a whole number of rows."""
    row = 2 * hidden
    if len(data) % row:
        raise ValueError(f"{len(data)} bytes is not a whole number of float16 rows of {hidden}")
    flat = torch.frombuffer(bytearray(data), dtype=torch.float16) if data else torch.zeros(0, dtype=torch.float16)
    return flat.view(-1, hidden).float()


@torch.inference_mode()
def grow_tree(model: EagleDraft, cache, position: int, logits: torch.Tensor, hidden: torch.Tensor, size: int,
              depth: int, branch: int, rank, min_score: float = float("-inf")) -> tuple[list[int], list[int]]:
    """Grow a draft tree of at most `size` nodes after the last committed token (EAGLE-2's dynamic tree).

    `cache` holds the draft's entries for every committed token; `logits` [n_out + 1] and `hidden` [H]
    are the draft's output at the last one, which the root's children sit after, at `position`.
    `rank(logits [N, n_out + 1]) -> [N, n_out]` log-scores of the next token (the caller's sampling
    processing; -inf: never proposed).

    Each of `depth` rounds expands the `branch` best nodes of the newest layer in one draft forward
    (each reads its parent's stand-in feature and attends to its own ancestors), giving each `branch`
    children. A node's score is the sum of its path's log-scores, the draft's estimate of the chance
    that the target accepts the whole path. The tree keeps the `size` best nodes (an ancestor always
    scores at least as high as its descendants, so the tree stays connected), in depth-first order,
    siblings best first: node 0, 1, ... is the draft's greedy chain as far as it was kept.

    With `min_score` (a log-chance), a node whose path scores below it is never added: the tree is
    smaller, or empty, where the draft is unsure, and stops growing when a layer adds nothing.

    Returns (draft ids, parents); the cache comes back holding the committed tokens only.
    """
    cached = cache.get_seq_length()
    device = model.device
    tokens: list[int] = []          # candidates: draft id, parent candidate (-1: root), score, depth
    parent_of: list[int] = []
    score: list[float] = []
    depth_of: list[int] = []
    fed: list[int] = []             # candidates fed to the draft, in cache order after `cached`
    stand_in: dict[int, torch.Tensor] = {-1: hidden}

    def add_children(parent: int, row: torch.Tensor) -> list[int]:
        base = score[parent] if parent >= 0 else 0.0
        values, ids = row.topk(min(branch, row.shape[-1]))
        new = []
        for value, index in zip(values.tolist(), ids.tolist()):
            if value == float("-inf") or base + value < min_score:
                break
            tokens.append(index)
            parent_of.append(parent)
            score.append(base + value)
            depth_of.append(depth_of[parent] + 1 if parent >= 0 else 0)
            new.append(len(tokens) - 1)
        return new

    layer = add_children(-1, rank(logits[None])[0])
    try:
        for d in range(1, depth):
            expand = sorted(layer, key=lambda c: -score[c])[:branch]
            if not expand:
                break
            ids = torch.tensor([[tokens[c] for c in expand]], dtype=torch.long, device=device)      # [1, P]
            prev = torch.stack([stand_in[parent_of[c]] for c in expand])[None].float()               # [1, P, H]
            mask = torch.zeros(len(expand), cached + len(fed) + len(expand), dtype=torch.bool, device=device)
            mask[:, :cached] = True
            for row, c in enumerate(expand):
                ancestor = c
                while ancestor >= 0:
                    column = cached + (fed.index(ancestor) if ancestor != c else len(fed) + row)
                    mask[row, column] = True
                    ancestor = parent_of[ancestor]
            positions = torch.full((1, len(expand)), position + d - 1, dtype=torch.long, device=device)
            out_logits, out_hidden = model(ids, prev, cache=cache, position_ids=positions,
                                           attention_mask=custom_attention_mask(model, mask[None, None]))
            fed.extend(expand)
            ranked = rank(out_logits[0])                                                             # [P, n_out]
            layer = []
            for row, c in enumerate(expand):
                stand_in[c] = out_hidden[0, row]
                layer += add_children(c, ranked[row])
    finally:
        held = cache.get_seq_length()
        if held > cached:
            cache.crop(cached - held)
    keep = sorted(range(len(tokens)), key=lambda c: (-score[c], depth_of[c]))[:size]
    kept = set(keep)
    keep = [c for c in keep if parent_of[c] < 0 or parent_of[c] in kept]   # connected, even on float ties
    kids: dict[int, list[int]] = {}
    for c in sorted(keep, key=lambda c: -score[c]):
        kids.setdefault(parent_of[c], []).append(c)
    order: list[int] = []
    stack = list(reversed(kids.get(-1, [])))
    while stack:   # depth first, best sibling first
        c = stack.pop()
        order.append(c)
        stack.extend(reversed(kids.get(c, [])))
    index = {c: i for i, c in enumerate(order)}
    return [tokens[c] for c in order], [index[parent_of[c]] if parent_of[c] >= 0 else -1 for c in order]

