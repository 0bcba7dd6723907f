"""blockformer: the Transformer's standard block, stacked into encoders, decoders and
encoder-decoders, with the training, generation and probes around it."""

from .config import TransformerConfig
from .nn import Block, KVCache
from .models import build_model, DecoderModel, EncoderModel, EncoderDecoderModel
from .stats import count_parameters, flops_per_token, memory_estimate
from .interop import from_hf, to_hf

__version__ = "0.1.0"

__all__ = [
    "TransformerConfig",
    "Block",
    "KVCache",
    "build_model",
    "DecoderModel",
    "EncoderModel",
    "EncoderDecoderModel",
    "count_parameters",
    "flops_per_token",
    "memory_estimate",
    "from_hf",
    "to_hf",
]
