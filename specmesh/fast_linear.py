"""Pre-packed fp32 weights for the CPU, so a (k + 1)-token verify costs about what a 1-token step does.

A Verify feeds k + 1 tokens: every nn.Linear becomes a thin matrix multiply
(M = 2..9 rows against a 576 x 1536 or 576 x 49152 weight). torch sends that
to MKL sgemm, which re-packs the weight into its blocked layout on every call
(all weights read and written once more per forward pass, as far as the
timings tell), and a 5-token forward of SmolLM2-135M costs 1.5-2x a 1-token
one (a 1-token forward is a matrix-vector product, which needs no packing).

oneDNN can pack a weight once (`mkldnn._reorder_linear_weight`) and then run
any M against the packed copy (`mkldnn._linear_pointwise`; the ops torch's
inductor uses for frozen CPU graphs). Measured with tools/verify_cost.py
(figures in docs/benchmarks.md) its cost hardly grows with M: 5 tokens cost
1.01-1.06x one. For M = 1 plain F.linear (MKL's matrix-vector path) measured
as fast, so single rows keep it (and give exactly the stock model's kernel).

The outputs are the same function computed by a different kernel: logits
agree to float rounding (~1e-5 relative), as they already do between the
1-token and the (k + 1)-token forward of the stock model.

"bf16" packs the weights in bfloat16 instead and rounds each linear layer's
input to bfloat16 (accumulation stays in fp32 inside oneDNN). It is for
drafts: one draft token is a lone row against every weight of the draft, so
its cost is the memory traffic of those weights (measured in a real propose
loop, each Linear ran 5x slower than with its weights hot in cache), and
bfloat16 halves it. Rows stay batch-invariant (oneDNN's bf16 kernels give
every row the same bits for any M >= 2, measured like the fp32 ones). A draft
in bf16 proposed the same held-out tokens as in fp32 (docs/benchmarks.md);
for a target it is a different model, so only on request.

Cost: one packed copy of every Linear weight is kept next to the original
(the original stays: the M = 1 path reads it, the output head shares it with
the token embedding). For SmolLM2-135M that is +540 MB and 1.5-2 s at start-up.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("specmesh.fast_linear")

__all__ = ["PackedLinear", "available", "pack_linears", "packed_while", "bf16_available"]


def available(model: nn.Module) -> bool:
    """Pre-packing applies to fp32 models on the CPU with a oneDNN-enabled torch."""
    try:
        param = next(model.parameters())
    except StopIteration:
        return False
    return (param.device.type == "cpu" and param.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def bf16_available() -> bool:
    """oneDNN runs bfloat16 matrix products on this CPU (natively, or AVX2's emulation, which is fast)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def onednn_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  min_rows: int = 2) -> torch.Tensor:
    """x [M, K] @ weight^T (+ bias) through oneDNN (weight: [N, K], plain or packed by
    `_reorder_linear_weight`). Fewer than `min_rows` rows are padded with copies of the last one:
    oneDNN gives every row the same bits for any M >= 2, and M = 1 takes another kernel
    (specmesh/invariant.py), so the pad changes no bits, only which kernel runs (choose_min_rows)."""
    m, least = x.shape[0], max(min_rows, 2)
    if m < least:
        rows = torch.cat([x, x[-1:].expand(least - m, -1)])
        return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An nn.Linear whose weight also lives in oneDNN's packed layout; same outputs."""

    def __init__(self, linear: nn.Linear, invariant: bool = False):
        super().__init__()
        # Batch-invariant numerics (specmesh/invariant.py): a lone row goes through oneDNN too, doubled,
        # since oneDNN gives every row the same bits for any M >= 2 and MKL's M = 1 path rounds otherwise.
        self.invariant = invariant
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight      # the same Parameter: ties (lm_head = embedding) survive
        self.bias = linear.bias
        # A buffer, not a Parameter: it is derived, and must not show up in state_dict.
        self.register_buffer("packed", None, persistent=False)
        self.packed_bias: torch.Tensor | None = None      # bf16: the bias in the weight's dtype
        self.use_fp32()
        self.min_rows = 2                                  # see choose_min_rows

    def use_bf16(self) -> None:
        """Pack the weight (and bias) in bfloat16: half the bytes per forward; inputs are rounded to bf16."""
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().to(torch.bfloat16), None)
            self.packed_bias = None if self.bias is None else self.bias.detach().to(torch.bfloat16)
        self.bf16 = True

    def use_fp32(self) -> None:
        """The weight packed in float32 (how a layer starts; undoes use_bf16)."""
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.packed_bias = None
        self.bf16 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # [..., in] -> [..., out]
        if x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if x.numel() == self.in_features and not self.invariant and not self.bf16:
            return F.linear(x, self.weight, self.bias)        # one row: MKL's matrix-vector path is fastest
        return self.product(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in] fp32 -> [M, out] fp32 through the packed weight."""
        if self.bf16:
            return onednn_matmul(rows.to(torch.bfloat16), self.packed, self.packed_bias, self.min_rows).float()
        return onednn_matmul(rows, self.packed, self.bias, self.min_rows)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed{' bf16' if self.bf16 else ''}{', batch-invariant' if self.invariant else ''}")


# Sibling projections that read the same input: one oneDNN product for each group instead of one per
# layer. Batch-invariant products give an output column the same bits whatever the other columns
# (specmesh/invariant.py: any N >= 2), so a fused product is the separate products' bits, and on a CPU
# each small product pays a fixed call cost: the 135M target's forward took 0.92x (1 token) and 0.94x
# (6 tokens) the unfused one, logits identical (docs/benchmarks.md, "Fused sibling products").
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _SiblingProduct:
    """The packed concatenation of sibling layers' weights; the product of the last input it saw, per
    thread, until every sibling has taken its part (transformers calls them one after another on the
    same tensor)."""

    def __init__(self, layers: list["PackedLinear"]):
        self.in_features = layers[0].in_features
        self.sizes = [layer.out_features for layer in layers]
        with torch.no_grad():
            weight = torch.cat([layer.weight.detach() for layer in layers])
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            biases = [layer.bias for layer in layers]
            self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.min_rows = 2                                  # see choose_min_rows
        self.last = threading.local()

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return onednn_matmul(rows, self.packed, self.bias, self.min_rows)

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        last = self.last
        if getattr(last, "input", None) is not x:
            rows = self.product(x.reshape(-1, self.in_features))    # [M, sum(sizes)]
            last.input, last.parts, last.taken = x, rows.split(self.sizes, dim=-1), set()
        # Contiguous, as a separate product's output is: the kernels after it see the layout they always saw.
        out = last.parts[index].contiguous().view(*x.shape[:-1], self.sizes[index])
        last.taken.add(index)
        if len(last.taken) == len(self.sizes):        # every sibling served: let the tensors go
            last.input = last.parts = None
        return out


class FusedPart(PackedLinear):
    """A batch-invariant PackedLinear whose product comes from its siblings' fused one (same bits)."""

    def __init__(self, layer: PackedLinear, group: _SiblingProduct, index: int):
        nn.Module.__init__(self)
        self.bf16, self.invariant = False, True
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias     # the same Parameters (state_dict, training)
        self.packed = self.packed_bias = None                 # the group holds the packed weight
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return self.group.part(x, self.index)

    def use_bf16(self) -> None:
        raise RuntimeError("a fused batch-invariant layer stays fp32 (fuse only models served in fp32)")


def fuse_siblings(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...], list[PackedLinear]]]:
    """Fuse each group of SIBLINGS that are batch-invariant fp32 PackedLinears over the same input size,
    in place. Returns (parent, names, the layers replaced) per group, for unfuse_siblings."""
    fused = []
    for parent in model.modules():
        for names in SIBLINGS:
            layers = [getattr(parent, name, None) for name in names]
            if not all(type(layer) is PackedLinear and layer.invariant and not layer.bf16 for layer in layers):
                continue
            if len({layer.in_features for layer in layers}) != 1 or len({layer.bias is None for layer in layers}) != 1:
                continue
            group = _SiblingProduct(layers)
            for index, (name, layer) in enumerate(zip(names, layers)):
                setattr(parent, name, FusedPart(layer, group, index))
            fused.append((parent, names, layers))
    return fused


def unfuse_siblings(fused) -> None:
    for parent, names, layers in fused:
        for name, layer in zip(names, layers):
            setattr(parent, name, layer)


def products(model: nn.Module) -> list:
    """The model's packed products (PackedLinear layers, and fused groups once each), in forward order."""
    found: dict[int, object] = {}
    for module in model.modules():
        product = module.group if isinstance(module, FusedPart) else module if isinstance(module, PackedLinear) \
            else None
        if product is not None:
            found.setdefault(id(product), product)
    return list(found.values())


def set_min_rows(model: nn.Module, rows: int) -> None:
    for product in products(model):
        product.min_rows = rows


MIN_ROWS_CANDIDATES = (2, 3, 4, 6, 8)


@torch.inference_mode()
def choose_min_rows(model: nn.Module, candidates: tuple[int, ...] = MIN_ROWS_CANDIDATES, rounds: int = 5) -> int:
    """Set the fewest rows the model's oneDNN products run with to the fastest of `candidates`, measured
    here; returns it.

    Why: which kernel oneDNN takes for a thin product depends on the CPU, and pays most on the 1- and
    2-token steps of target-only decoding and of a draft. On the AVX2 EPYCs this was built on, a lone
    row doubled was the fastest; on an AVX-512 Zen 4 EPYC the 135M target's 1-token step took 41.6 ms
    with its rows padded to 4 against 49.9 ms doubled (2 threads; 50.2 against 66.6 on 1), and a 2-token
    step gained as much (docs/benchmarks.md, "Thin products padded"). Rows do not depend on M >= 2, so the
    choice changes no bits, only time.

    How: one row through every product of the model in forward order, as a 1-token step reads them (a
    model larger than the caches reads its weights from memory, as it will when served), candidates
    interleaved round by round, the lowest median kept.
    """
    found = products(model)
    if not found:
        return 2
    inputs = [torch.randn(1, product.in_features) for product in found]
    times: dict[int, list[float]] = {rows: [] for rows in candidates}
    for round_ in range(rounds + 1):
        for rows in candidates:
            for product in found:
                product.min_rows = rows
            began = time.perf_counter()
            for product, x in zip(found, inputs):
                product.product(x)
            if round_:                                  # round 0 warms every kernel up
                times[rows].append(time.perf_counter() - began)
    medians = {rows: sorted(t)[len(t) // 2] for rows, t in times.items()}
    best = min(candidates, key=lambda rows: medians[rows])
    for product in found:
        product.min_rows = best
    log.info("thin oneDNN products padded to %d rows (one row through every product: %s)", best,
             ", ".join(f"{rows} rows {medians[rows] * 1e3:.2f} ms" for rows in candidates))
    return best


def pack_linears(model: nn.Module, invariant: bool = False) -> int:
    """Replace every nn.Linear of a CPU fp32 model by a PackedLinear, in place.

    Returns how many were replaced (0 where packing does not apply: another
    device or dtype, or a torch without oneDNN). With `invariant`, layers packed
    earlier switch to batch-invariant numerics too.
    """
    return len(_pack(model, invariant))


def _pack(model: nn.Module, invariant: bool = False) -> list[tuple[nn.Module, str, nn.Linear]]:
    """pack_linears; -> (parent, name, the nn.Linear it replaced) for each layer it packed."""
    if not available(model):
        return []
    started = time.monotonic()
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.invariant = module.invariant or invariant
    replaced = [(parent, name, child) for parent in model.modules()
                for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in replaced:
        setattr(parent, name, PackedLinear(child, invariant))
    log.info("pre-packed %d linear weights for oneDNN in %.2f s", len(replaced), time.monotonic() - started)
    return replaced


@contextlib.contextmanager
def packed_while(model: nn.Module):
    """Pre-packed linear layers for the duration of the block (yields how many were packed), the model's
    own nn.Linear modules after it (the very objects, over the same Parameters; the packed copies are
    freed): for work that only runs the model forward, like `specmesh distill`'s batched generations, on a
    model that is copied or trained afterwards (a packed copy would go stale)."""
    replaced = _pack(model)
    try:
        yield len(replaced)
    finally:
        for parent, name, linear in replaced:
            setattr(parent, name, linear)


def apply_kernels(model: nn.Module, kernels: str, batch_invariant: bool = False, min_rows: int = 0) -> None:
    """Set up a loaded model's linear layers as `kernels` names (one call, at model load).

    "packed": PackedLinear where it applies (CPU, fp32; a no-op elsewhere), same outputs.
    "bf16": the same, with weights packed in bfloat16 (for drafts; a different model for a target).
    "stock": torch's own nn.Linear.
    "int8-dynamic": specmesh.quantize; a different model, so never a silent default for a target.
    `batch_invariant` (with "packed" or "bf16"): attention too runs on oneDNN products, so a
    position's logits are the same bits however it is batched or chunked (specmesh/invariant.py), and a
    causal LM's forward runs without transformers' per-layer plumbing where a probe shows the same bits
    (specmesh/lean_decoder.py).
    `min_rows` (packed or bf16): the fewest rows a product runs with, fewer padded (same bits);
    0: measured here for batch-invariant models (choose_min_rows), 2 otherwise.
    """
    from specmesh.config import LINEAR_KERNELS

    if kernels not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear kernels {kernels!r}; choose one of {', '.join(LINEAR_KERNELS)}")
    if kernels in ("packed", "bf16"):
        packed = False
        if batch_invariant:
            from specmesh.invariant import make_batch_invariant

            # bf16 repacks each layer's weight, so fuse only what stays fp32.
            packed = make_batch_invariant(model, fuse=kernels == "packed" or not bf16_available())
            log.info("batch-invariant numerics: %s", "oneDNN linear layers and attention" if packed else "off")
        if not packed:
            pack_linears(model)
        if kernels == "bf16":
            _use_bf16(model)
        if packed:   # last: its probe runs the layers as they will be served
            from specmesh.lean_decoder import use_lean_forward

            use_lean_forward(model)
        if min_rows:
            set_min_rows(model, min_rows)
        elif packed:
            choose_min_rows(model)
        return
    if kernels == "int8-dynamic":
        from specmesh.quantize import quantize_linears

        quantize_linears(model, kernels)
    if batch_invariant:
        log.warning("batch_invariant is on, but linear_kernels=%s cannot provide it: off", kernels)


def _use_bf16(model: nn.Module) -> None:
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not layers:
        log.info("linear_kernels=bf16 applies to fp32 models on a CPU: a no-op here")
        return
    if not bf16_available():
        log.warning("linear_kernels=bf16: this CPU's oneDNN has no bfloat16 products; the layers stay fp32")
        return
    for layer in layers:
        layer.use_bf16()
    log.info("%d linear layers in bfloat16 (oneDNN packed)", len(layers))
