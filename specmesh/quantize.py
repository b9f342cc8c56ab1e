"""int8 linear layers for a model's forward pass on the CPU.

A quantized model is a different model: its outputs differ from the fp32 one
by quantization error. That is harmless for a draft (the verifier's rule stays
exact; only the acceptance rate can move, and it is measured) and changes the
output for a target, so the verifier offers it only as an explicit choice.

Methods:
- "int8-weight": weight-only, per-output-channel symmetric int8; activations
  stay fp32 (`aten._weight_int8pack_mm`, the kernel gpt-fast uses on CPUs).
  Reads a quarter of the fp32 bytes per token.
- "int8-dynamic": torch.ao dynamic quantization (fbgemm/oneDNN): activations
  are quantized per call too. Deprecated in torch >= 2.10 but still shipped.
"""
from __future__ import annotations

import logging
import time
import warnings

import torch
from torch import nn

log = logging.getLogger("specmesh.quantize")

METHODS = ("none", "int8-weight", "int8-dynamic")


class Int8WeightLinear(nn.Module):
    """nn.Linear with an int8 weight and one fp32 scale per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()                                  # [out, in]
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0               # [out]
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                    # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)   # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace the model's nn.Linear layers by int8 ones, in place; returns how many.

    CPU only: both kernels are CPU kernels, and a GPU has better options.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")
    if method == "none":
        return 0
    device = next(model.parameters()).device
    if device.type != "cpu":
        log.warning("%s quantization runs on the CPU only; the model on %s stays as loaded", method, device)
        return 0
    started = time.monotonic()
    if method == "int8-dynamic":
        from torch.ao.quantization import quantize_dynamic

        count = sum(1 for m in model.modules() if type(m) is nn.Linear)
        with warnings.catch_warnings():   # the deprecation notice, once per layer
            warnings.simplefilter("ignore")
            quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    else:
        targets = [(parent, name, child) for parent in model.modules()
                   for name, child in parent.named_children() if type(child) is nn.Linear]
        for parent, name, child in targets:
            setattr(parent, name, Int8WeightLinear(child))
        count = len(targets)
    log.info("quantized %d linear layers (%s) in %.2f s", count, method, time.monotonic() - started)
    return count
