"""Int8 weight-only quantization for decoding (as gpt-fast does).

At batch 1 a decode step is bound by reading every weight from memory once per token, so
storing the matmul weights as int8 (one scale per output channel) reads 4x fewer bytes
than fp32 and 2x fewer than bf16. Activations stay in floating point; only the weights are
rounded, to ``round(w / s)`` with ``s = max|w_row| / 127``. This is for inference: the
quantized model cannot be trained, and its logits differ slightly from the float model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W = scales[:, None] * int8_weight``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x.device.type == "cpu":  # a fused int8-weight GEMM (PyTorch's CPU kernel)
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales.to(x.dtype))
        else:  # elsewhere: dequantize in the matmul's dtype; torch.compile fuses it
            y = F.linear(x2, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (attention, FFN, output head) in place by an
    ``Int8Linear``; embeddings and norms keep their dtype. A head tied to the embedding gets
    its own int8 copy. Returns ``model``, in eval mode."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model.eval()
