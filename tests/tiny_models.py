"""Tiny random causal LMs for tests: real HF model folders that load in milliseconds.

``build_tiny_model(path, seed=..., vocab=...)`` writes a folder that
``specmesh.models.load_model(str(path))`` loads like any downloaded model: a
two-layer Llama with random weights and a genuine ``tokenizers`` fast tokenizer
(with a chat template), so the draft/verifier/orchestrator code paths run
unchanged against it.

Two models built with the same ``vocab`` share their token->id mapping whatever
the seed, so any two seeds make a valid draft/target pair; the vocabularies are
deliberately different from each other so mismatch handling can be tested too.

- ``vocab="chars"``: one token per character (lowercase letters, digits, space,
  newline, basic punctuation) plus ``<s>``/``</s>``/``<unk>``. Input is lowercased,
  so any ASCII text encodes; decoding concatenates characters, so
  ``decode(encode(text)) == text.lower()`` for text within the alphabet.
- ``vocab="tiny"``: only ``a``..``h`` plus ``</s>`` and ``<unk>`` -- small enough that
  tests can compare sampled token frequencies against the full distribution.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["build_tiny_model", "VOCABS"]

_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,!?'-:\n")

# Specials come first so their ids are identical across vocabularies' layouts
# and easy to recognise in test failures.
VOCABS: dict[str, dict] = {
    "chars": {
        "specials": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
        "ordinary": _CHARS,
        # Role markers are spelled in the alphabet itself, so a rendered chat
        # encodes without <unk> and can be decoded back for inspection.
        "chat_template": (
            "{% for message in messages %}"
            "{{ '<s>' + message['role'] + ': ' + message['content'] + '\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<s>assistant: ' }}{% endif %}"
        ),
    },
    "tiny": {
        "specials": {"unk_token": "<unk>", "eos_token": "</s>"},
        "ordinary": list("abcdefgh"),
        # No role markers fit in an 8-letter alphabet; the content is the prompt.
        "chat_template": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
    },
}


def _build_tokenizer(vocab: str):
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    spec = VOCABS[vocab]
    specials = list(spec["specials"].values())
    token_to_id = {tok: i for i, tok in enumerate(specials + spec["ordinary"])}

    # BPE without merges is a character-level model that keeps spaces and
    # newlines as tokens (a WordLevel model would need a pre-tokenizer that
    # splits on them and loses them).
    backend = Tokenizer(models.BPE(vocab=token_to_id, merges=[], unk_token=spec["specials"]["unk_token"]))
    backend.normalizer = normalizers.Lowercase()
    # Fuse joins decoded tokens with nothing in between; the default would put
    # a space between every character.
    backend.decoder = decoders.Fuse()
    # No post-processor: encode() adds no BOS/EOS, so token counts equal
    # character counts, which keeps position arithmetic in tests obvious.

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        clean_up_tokenization_spaces=False,  # would turn "a ." into "a." and break round trips
        model_max_length=512,
        **spec["specials"],
    )
    # Batched verification pads; EOS is the conventional pad for causal LMs.
    tokenizer.pad_token = spec["specials"]["eos_token"]
    tokenizer.chat_template = spec["chat_template"]
    return tokenizer


def build_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    vocab: str = "chars",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    init_std: float = 0.5,
) -> Path:
    """Write a random tiny Llama + tokenizer into ``path`` (created if missing) and return it.

    ``init_std`` is far above the usual 0.02 so that logits are peaked: tests
    compare argmax across differently batched forward passes, and near-ties
    would make those comparisons flaky on float rounding alone.
    """
    if vocab not in VOCABS:
        raise ValueError(f"unknown tiny vocab {vocab!r}; choose one of {sorted(VOCABS)}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = _build_tokenizer(vocab)
    vocab_size = len(tokenizer.get_vocab())

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=512,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)

    # Re-initialise explicitly from a private generator: the weights then
    # depend on `seed` alone, not on the global RNG state or on how a given
    # transformers version runs its own init.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)

    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
