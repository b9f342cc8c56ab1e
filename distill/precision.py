"""The precision of distill's products: training's (--train-precision) and the data phase's
(--generation-precision).

"bf16" multiplies in bfloat16 where it is native and keeps everything else in float32. On the 2-core
Zen 4 build machine (AVX512-BF16) an EAGLE training step of 2,048 tokens took 0.89 s against 1.37 in
float32, and the target generated greedy answers in 48-row batches 1.27-1.29x faster (docs/distill.md,
"The hour: the target's products in bfloat16").
Where bfloat16 products are emulated (AVX2) they are slower than float32, so "auto" takes bf16 only
where the device multiplies bfloat16 natively.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(requested: str, device) -> str:
    """A precision option for `device`: "fp32" or "bf16" ("auto": bf16 where its products are native)."""
    if requested not in PRECISIONS:
        raise ValueError(f"unknown precision {requested!r}; choose one of {', '.join(PRECISIONS)}")
    if requested != "auto":
        return requested
    kind = torch.device(device).type
    if kind == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if kind != "cpu":
        return "fp32"
    cpu = getattr(torch, "cpu", None)
    native = any(getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported",
                                                                     "_is_amx_tile_supported"))
    return "bf16" if native else "fp32"


class _Bf16Products(torch.nn.Module):
    """An nn.Linear's product in bfloat16 (input and a bf16 copy of the weight), its output in the input's dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight16 = linear.weight.detach().to(torch.bfloat16)
        self.bias16 = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight16, self.bias16).to(x.dtype)


@contextlib.contextmanager
def products_in(model: torch.nn.Module, precision: str):
    """Run `model`'s linear products in `precision` ("fp32" or "bf16", resolved) inside the block.

    bf16: pre-packed layers (specmesh.fast_linear.PackedLinear, the data phase's default on a CPU) are
    repacked in bfloat16 and back to float32 afterwards; any other nn.Linear is swapped for one that
    multiplies a bfloat16 copy of its weight, and put back. (Not an autocast: the data phase's own
    float16 bookkeeping would go through it too.) Either way the weights themselves stay float32, so
    what follows the block (training copies the target's last layer) reads them unchanged."""
    if precision == "fp32":
        yield
        return
    from specmesh.fast_linear import PackedLinear

    packed = [layer for layer in model.modules() if type(layer) is PackedLinear]
    swapped = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]
    for layer in packed:
        layer.use_bf16()
    for parent, name, child in swapped:
        setattr(parent, name, _Bf16Products(child))
    try:
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
        for layer in packed:
            layer.use_fp32()
