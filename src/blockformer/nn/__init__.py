"""Building blocks, in the order data flows through them."""

from .dropout import Dropout  # noqa: F401
from .position import AbsolutePosition, AlibiBias, RelativeBias, Rotary, apply_rope  # noqa: F401
from .attention import Attention, AttnInputs  # noqa: F401
from .feedforward import FeedForward  # noqa: F401
from .norm import build_norm  # noqa: F401
from .residual import Residual  # noqa: F401
from .block import Block  # noqa: F401
from .stack import Stack  # noqa: F401
from .kv_cache import KVCache  # noqa: F401
