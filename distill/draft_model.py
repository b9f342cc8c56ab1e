"""Build the draft from its target: the target's config with fewer layers and a
reduced vocabulary, initialised from the target's own weights (embedding rows
of the chosen tokens, its first decoder layers, its final norm), so training
starts from a model that already reads the target's representation.
"""
from __future__ import annotations

from typing import Sequence

import torch


def build_draft(target_model, draft_to_target: Sequence[int], layers: int, from_last: bool = False):
    """The draft LM; its decoder layers are copies of the target's first `layers` (or last, `from_last`)."""
    from transformers import AutoModelForCausalLM

    config = target_model.config.__class__.from_dict(target_model.config.to_dict())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    source_layers = _decoder_layers(target_model)
    if layers > len(source_layers):
        raise ValueError(f"--layers {layers} exceeds the target's {len(source_layers)} decoder layers")
    text.num_hidden_layers = layers
    text.vocab_size = len(draft_to_target) + 1
    text.tie_word_embeddings = True       # one matrix for input and output: half the size on disk
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(text, name, None)         # target ids mean nothing in the draft's vocabulary
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    ids = torch.tensor(list(draft_to_target), dtype=torch.long)
    with torch.no_grad():
        source = target_model.get_input_embeddings().weight.float()                      # [V_t, H]
        rest = torch.ones(source.shape[0], dtype=torch.bool)
        rest[ids] = False
        other = source[rest].mean(0, keepdim=True) if rest.any() else source.mean(0, keepdim=True)  # [1, H]
        draft.get_input_embeddings().weight.copy_(torch.cat([source[ids], other]))      # [n_out + 1, H]
        chosen = list(source_layers)[-layers:] if from_last else list(source_layers)[:layers]
        for mine, theirs in zip(_decoder_layers(draft), chosen):
            mine.load_state_dict(theirs.state_dict())
        _final_norm(draft).load_state_dict(_final_norm(target_model).state_dict())
    draft.tie_weights()
    return draft


def _decoder_layers(model):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers in {type(model).__name__}: distill supports Llama-like "
                         "models (model.model.layers)")
    return layers


def _final_norm(model):
    return model.model.norm


def build_eagle(target_model, draft_to_target: Sequence[int], layers: int = 1):
    """An EAGLE draft (specmesh.eagle) for the target: the draft LM built from the target's last
    `layers` decoder layers (they already read features like the ones the draft continues), and
    an `fc` that starts by handing the layer the feature (un-normed) plus the token (at the same scale)."""
    from specmesh.eagle import EagleDraft

    model = EagleDraft(build_draft(target_model, draft_to_target, layers, from_last=True))
    hidden = model.hidden_size
    with torch.no_grad():
        # The head decides what is proposed: it is the target's own output rows (its input rows
        # when the two are tied, as in SmolLM2), and the tied input embedding shares them.
        output = target_model.get_output_embeddings().weight.float()                # [V_t, H]
        ids = torch.tensor(list(draft_to_target), dtype=torch.long)
        table = model.lm.get_input_embeddings().weight
        table[:-1].copy_(output[ids])
        # A feature is the target's final norm applied to its residual stream; the draft applies the
        # same norm at its end. Dividing by the norm's weight hands the layer a residual-like input,
        # so an untrained draft gives back the feature it read (h_j = f_{j-1}) instead of one scaled
        # by the weight twice: training starts from "copy" and learns the step forward.
        weight = _final_norm(target_model).weight.detach().float()                  # [H]
        safe = torch.where(weight.abs() < 1e-3, torch.full_like(weight, 1e-3), weight)
        # The token's embedding is scaled to the same unit RMS, so the layer sees both from the start
        # (SmolLM2's rows have RMS ~0.14 against ~1: unscaled, the token was all but invisible).
        token_scale = 1.0 / float(table[:-1].pow(2).mean().sqrt().clamp(min=1e-6))
        model.fc.weight.zero_()
        model.fc.weight[:, :hidden].copy_(torch.eye(hidden) * token_scale)
        model.fc.weight[:, hidden:].copy_(torch.diag(1.0 / safe))
        model.fc.bias.zero_()
    return model
