"""Training: the loop, and the small pieces it is made of (optimizer, schedules, loss,
precision, checkpoints, metrics)."""

from ..nn.loss import token_loss
from .checkpoint import resolve_checkpoint, save_checkpoint, unwrap
from .load import Checkpoint, load_checkpoint
from .loop import TrainResult, train
from .optim import build_optimizer, param_groups
from .schedule import constant, cosine, noam

__all__ = [
    "train",
    "TrainResult",
    "Checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "resolve_checkpoint",
    "unwrap",
    "build_optimizer",
    "param_groups",
    "noam",
    "cosine",
    "constant",
    "token_loss",
]
