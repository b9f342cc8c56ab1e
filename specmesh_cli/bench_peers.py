"""`specmesh bench --peers hf`: the same prompts through Hugging Face transformers, in process.

The peers run right after our configurations for each prompt (interleaved,
so machine load hits both alike), on the same target weights and the same
prompt token ids (the orchestrator's own tokenization), with as many torch
threads as the verifier gets. Each peer row looks like one of ours, so the
table, CSV and chart show them side by side; greedy peers are checked token
for token against our target-only output.

Peers:
- `hf:generate`: plain `model.generate` (target only; HF's own baseline).
- `hf:lookup=N`: prompt lookup decoding (`prompt_lookup_num_tokens=N`), one
  row per N in --peer-lookup-tokens; the summary names the best.
- `hf:assisted=N`: assisted generation with the draft model as
  `assistant_model`, N tokens per step (`num_assistant_tokens`, constant
  schedule, HF's default confidence threshold), one row per N. A plain
  full-vocabulary draft is used as it is. A distilled draft (a folder with
  vocab_map.json: an LM over a subset of the target's tokens plus an input
  "other" bucket) becomes an equivalent full-vocabulary HF model in memory
  (`full_vocab_assistant`): its embedding gets one row per target token (the
  subset's own rows, the "other" row for the rest) and its head scatters the
  subset's logits into the target's vocabulary, every other token at the
  lowest float. The head still costs what the subset's does, so HF pays what
  we pay per draft token. A draft that fits neither is skipped with the reason.

Steps are counted as the target's forward passes (a hook), so committed
tokens per step are comparable with ours.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from specmesh_cli import launcher

log = logging.getLogger("specmesh.bench")

PEERS = ("hf",)
VOCAB_MAP_FILE = "vocab_map.json"   # marks a distilled draft folder (specmesh.distilled)


def add_arguments(p) -> None:
    p.add_argument("--peers", default="", choices=("", *PEERS),
                   help="also run the prompts in process with these peers, interleaved with ours (hf)")
    p.add_argument("--peer-lookup-tokens", default="4,10",
                   help="prompt_lookup_num_tokens settings for the HF prompt-lookup peer, comma-separated")
    p.add_argument("--peer-assistant-tokens", default="",
                   help="num_assistant_tokens settings for HF assisted generation (default: the k of our configs)")


def verifier_threads() -> int:
    """The torch threads of the one verifier `specmesh bench` starts (the launcher's rule)."""
    configured = os.environ.get("SPECMESH_TORCH_THREADS")
    if configured and int(configured) > 0:
        return int(configured)
    return launcher.verifier_threads(replicas=1)


@dataclass
class HFPeers:
    """The target (and draft) loaded with transformers, and the peer settings to run per prompt."""

    target: object                      # specmesh.models.LoadedModel
    draft: object | None                # a LoadedModel usable as assistant_model, else None
    lookup_tokens: list[int]
    assistant_tokens: list[int]
    threads: int
    temperature: float = 0.0
    skipped: list[str] = field(default_factory=list)   # peers not run, with the reason
    _forwards: int = 0

    @classmethod
    def load(cls, model: str | None, draft_model: str | None, lookup_tokens: list[int],
             assistant_tokens: list[int], temperature: float, threads: int | None = None) -> "HFPeers":
        import torch

        from specmesh.models import DEFAULT_MODEL, VocabularyMismatch, check_same_vocab, load_model

        threads = threads or verifier_threads()
        torch.set_num_threads(threads)
        target = load_model(model or DEFAULT_MODEL)    # stock transformers model, fp32, as HF users run it
        draft, skipped = None, []
        if draft_model:
            from specmesh.drafts import resolve_draft

            draft_model = resolve_draft(draft_model)     # a shipped draft's name -> its folder
            try:
                if (Path(draft_model).expanduser() / VOCAB_MAP_FILE).is_file():
                    draft = full_vocab_assistant(Path(draft_model).expanduser(), target.info)
                else:
                    draft = load_model(draft_model)
                    check_same_vocab(draft.info, target.info)
            except (VocabularyMismatch, Exception) as err:   # noqa: BLE001 - reported, and the other peers run
                skipped.append(f"hf:assisted: draft {draft_model!r} is not a plain full-vocabulary LM "
                               f"for this target ({err})")
                draft = None
        else:
            skipped.append("hf:assisted: no --draft-model")
        peers = cls(target, draft, lookup_tokens, assistant_tokens if draft is not None else [], threads,
                    temperature, skipped)
        target.model.register_forward_hook(peers._count)
        for reason in skipped:
            log.warning("peer skipped: %s", reason)
        log.info("HF peers on %d torch threads: generate, lookup %s, assisted %s", threads, lookup_tokens,
                 peers.assistant_tokens)
        return peers

    def _count(self, module, inputs, output) -> None:
        self._forwards += 1

    def settings(self) -> list[tuple[str, dict]]:
        """(config name, extra generate() arguments) for every peer run per prompt."""
        runs = [("hf:generate", {})]
        runs += [(f"hf:lookup={n}", {"prompt_lookup_num_tokens": n}) for n in self.lookup_tokens]
        runs += [(f"hf:assisted={n}", {"assistant_model": self.draft.model, "_assistant_tokens": n})
                 for n in self.assistant_tokens]
        return runs

    def generate(self, prompt_ids: list[int], max_new_tokens: int, extra: dict, seed: int) -> tuple[list[int], float, int]:
        """One peer run: (new token ids, cut at the first EOS like ours; seconds; target forwards)."""
        import torch

        extra = dict(extra)
        n_assistant = extra.pop("_assistant_tokens", None)
        if n_assistant is not None:
            gc = self.draft.model.generation_config
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = n_assistant, "constant"
        eos = list(self.target.info.eos_token_ids)
        sampling = ({"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
                    if self.temperature > 0 else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None})
        ids = torch.tensor([prompt_ids], dtype=torch.long)                       # [1, P]
        torch.manual_seed(seed)
        self._forwards = 0
        began = time.perf_counter()
        with torch.inference_mode():
            out = self.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                             eos_token_id=eos, pad_token_id=eos[0], **sampling, **extra)  # [1, P + N]
        elapsed = time.perf_counter() - began
        new = out[0, len(prompt_ids):].tolist()
        for i, token in enumerate(new):
            if token in eos:
                new = new[:i + 1]
                break
        return new, elapsed, self._forwards

    def run_prompt(self, prompt_ids: list[int], question: dict, baseline_ids: list[int] | None,
                   max_new_tokens: int) -> list[dict]:
        """Every peer setting on one prompt; rows shaped like bench.measure's."""
        rows = []
        for name, extra in self.settings():
            new, elapsed, forwards = self.generate(prompt_ids, max_new_tokens, extra, question["question_id"])
            steps = max(1, forwards - 1)     # the first forward is the prefill, which also gives token 1
            rows.append({"question_id": question["question_id"], "category": question["category"], "config": name,
                         "drafter": name.split("=")[0], "k": int(name.split("=")[1]) if "=" in name else 0,
                         "prompt_tokens": len(prompt_ids), "committed_tokens": len(new), "elapsed_s": elapsed,
                         "ttft_s": None,
                         "tokens_per_second": len(new) / elapsed if elapsed else 0.0, "steps": steps,
                         "draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": 0.0,
                         "committed_per_step": len(new) / steps,
                         "same_as_target_only": (new == baseline_ids) if baseline_ids is not None and not self.temperature
                         else None})
        return rows


def full_vocab_assistant(folder: Path, target_info) -> SimpleNamespace:
    """A distilled draft folder -> an HF causal LM over the target's whole vocabulary, same predictions.

    Reads vocab_map.json (format specmesh-distilled-draft/1: draft id -> target id,
    one extra input-only "other" id) and refuses a map made for another target.
    """
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    class ScatterHead(nn.Module):
        """A reduced-vocabulary output head seen as a full-vocabulary one: [..., H] -> [..., V_target]."""

        def __init__(self, head: nn.Module, draft_to_target: torch.Tensor, target_vocab_size: int):
            super().__init__()
            self.head = head
            self.register_buffer("draft_to_target", draft_to_target)      # [n_out] target ids
            self.target_vocab_size = target_vocab_size

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            small = self.head(hidden)[..., :len(self.draft_to_target)]      # [..., n_out]; drops "other"
            out = small.new_full((*small.shape[:-1], self.target_vocab_size), torch.finfo(small.dtype).min)
            out[..., self.draft_to_target] = small
            return out                                                      # [..., V_target]

    raw = json.loads((folder / VOCAB_MAP_FILE).read_text())
    if (raw["target_fingerprint"], int(raw["target_vocab_size"])) != (target_info.vocab_fingerprint,
                                                                       target_info.vocab_size):
        raise ValueError(f"its vocabulary map was made for {raw.get('target_name')!r}, not {target_info.name!r}")
    draft_to_target = torch.tensor(raw["draft_to_target"], dtype=torch.long)          # [n_out]
    n_out, vocab = len(draft_to_target), target_info.vocab_size
    try:   # the draft service's own loader reads every storage format `specmesh distill` writes (int8 too)
        from specmesh.distilled import load_draft
    except ImportError:
        load_draft = None
    if load_draft is not None:
        model = load_draft(str(folder), target=target_info).model
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    small_embedding = model.get_input_embeddings().weight.detach()                     # [n_out + 1, H]
    target_to_draft = torch.full((vocab,), n_out, dtype=torch.long)                   # "other" by default
    target_to_draft[draft_to_target] = torch.arange(n_out)
    embedding = nn.Embedding(vocab, small_embedding.shape[1])
    embedding.weight = nn.Parameter(small_embedding[target_to_draft].clone(), requires_grad=False)  # [V_target, H]
    head = model.get_output_embeddings()
    model.config.tie_word_embeddings = False
    model.set_input_embeddings(embedding)
    model.lm_head = ScatterHead(head, draft_to_target, vocab)
    model.config.vocab_size = vocab
    return SimpleNamespace(model=model, info=target_info)


def best_peer(summary: list[dict], prefix: str, category: str = "overall") -> dict | None:
    """The fastest summary row of one peer family (e.g. "hf:lookup") in a category."""
    rows = [s for s in summary if s["category"] == category and s["config"].startswith(prefix)]
    return max(rows, key=lambda s: s["tokens_per_second"]) if rows else None


def comparison_lines(summary: list[dict]) -> list[str]:
    """Ours against each peer family's best setting, overall: tokens/s ratios."""
    ours = [s for s in summary if s["category"] == "overall" and not s["config"].startswith("hf:")]
    lines = []
    for family in ("hf:generate", "hf:lookup", "hf:assisted"):
        peer = best_peer(summary, family)
        if peer is None:
            continue
        lines.append(f"{family:<12} best setting {peer['config']:<16} {peer['tokens_per_second']:6.1f} tok/s; "
                     + ", ".join(f"{s['config']} {s['tokens_per_second'] / peer['tokens_per_second']:.2f}x"
                                 for s in ours))
    return lines
