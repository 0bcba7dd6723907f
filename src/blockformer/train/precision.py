"""Where and in what precision to train: the device, autocast, and fp16's grad scaler.

``bf16`` runs the matmuls in bfloat16 under ``torch.autocast`` (weights and optimizer state
stay float32), on CUDA and on CPUs with bf16 units (AMX/AVX512-BF16). ``fp16`` has too
little range for unscaled gradients, so it needs a loss scaler (Micikevicius et al. 2018);
it is offered on CUDA only.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` without a GPU is a usage error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("train.device='cuda': no CUDA device is available; expected 'auto' or 'cpu'")
    return torch.device(name)


def check_precision(precision: str, device: torch.device) -> None:
    if precision == "fp16" and device.type != "cuda":
        raise UsageError(
            f"train.precision='fp16': needs a CUDA device (got {device.type}); expected 'bf16' or 'fp32' here"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError("train.precision='bf16': this GPU lacks bfloat16; expected 'fp16' or 'fp32'")


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward-pass context for ``precision``: a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A loss scaler, enabled only for fp16 (a disabled one passes calls through)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
