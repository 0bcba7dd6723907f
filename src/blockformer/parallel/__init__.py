"""Training on many processes: data, tensor and pipeline parallelism over one ``DeviceMesh``.

The model code (``nn/``, ``models/``) is single-device; this package wraps a finished
model for a ``torchrun`` job, in torchtitan's order: tensor parallel (``tensor``),
activation checkpointing (``activation``), compile, then FSDP2 or DDP (``fsdp``);
pipeline stages split the decoder first (``pipeline``). Under TP, ``sequence`` shards
the norms between sublayers on the sequence dim and ``loss`` keeps the logits split by
vocabulary in the training loss. ``data`` gives each rank its slice of the global batch, ``checkpoint`` writes and reads sharded checkpoints,
``meta`` builds a model on the meta device and fills in each rank's shards, ``plan`` sizes a run on paper and
``simulate`` checks it on torch's fake process group.
"""

from .loss import loss_context
from .runtime import Local, Parallel, parallelize, start

__all__ = ["Local", "Parallel", "loss_context", "parallelize", "start"]
