"""The precision of distill's products: training's (--train-precision) and the data phase's
(--generation-precision).

"bf16" multiplies in bfloat16 where it is native and keeps everything else in float32. On the 2-core
Zen 4 build machine (AVX512-BF16) an EAGLE training step of 2,048 tokens took 0.89 s against 1.37 in
float32, and a 48-row greedy decode step of the target 1.29x less time (docs/distill.md, "The hour").
Where bfloat16 products are emulated (AVX2) they are slower than float32, so "auto" takes bf16 only
where the device multiplies bfloat16 natively.
"""
from __future__ import annotations

import contextlib

import torch

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


@contextlib.contextmanager
def products_in(model: torch.nn.Module, precision: str):
    """Run `model`'s linear products in `precision` ("fp32" or "bf16", resolved) inside the block.

    bf16: pre-packed layers (specmesh.fast_linear.PackedLinear, the data phase's default on a CPU) are
    repacked in bfloat16 and back to float32 afterwards; any other model runs under a bfloat16 autocast.
    Either way the weights themselves stay float32, so what follows the block (training copies the
    target's last layer) reads them unchanged."""
    if precision == "fp32":
        yield
        return
    from specmesh.fast_linear import PackedLinear

    packed = [layer for layer in model.modules() if type(layer) is PackedLinear]
    if not packed:
        device = next(model.parameters()).device.type
        with torch.autocast(device, dtype=torch.bfloat16):
            yield
        return
    for layer in packed:
        layer.use_bf16()
    try:
        yield
    finally:
        for layer in packed:
            layer.use_fp32()
