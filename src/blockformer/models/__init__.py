"""The three architectures built from the one block, and ``build_model``."""

from __future__ import annotations

import torch

from ..config import TransformerConfig
from .base import TransformerModel
from .checks import check_config, check_seed
from ..nn.moe import routing_stats
from .decoder import DecoderModel
from .encoder import EncoderModel
from .encoder_decoder import EncoderDecoderModel

MODELS: dict[str, type[TransformerModel]] = {
    "encoder": EncoderModel,
    "decoder": DecoderModel,
    "encoder-decoder": EncoderDecoderModel,
}


def build_model(
    cfg: TransformerConfig, *, seed: int | None = None, device: torch.device | str | None = None
) -> TransformerModel:
    """The model ``cfg`` describes, initialised (reproducibly when ``seed`` is given)."""
    check_config(cfg)
    check_seed(seed)
    if seed is None:
        model = MODELS[cfg.arch](cfg)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = MODELS[cfg.arch](cfg)
    return model.to(device) if device is not None else model


__all__ = ["MODELS", "build_model", "TransformerModel", "DecoderModel", "EncoderModel", "EncoderDecoderModel",
           "training_metrics"]


def training_metrics(model: torch.nn.Module) -> dict:
    """What a model reports about its last forward, for ``metrics.jsonl``: the MoE routing
    (each expert's share, the fraction dropped, the balance and z losses); empty without MoE."""
    return routing_stats(model)
