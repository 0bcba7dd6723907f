"""The local web view over runs, checkpoints and the server: ``blockformer view``.

Pages read what exists through the public Python API (``runs.py``: run directories and
their ``metrics.jsonl``; ``checkpoints.py``: a checkpoint's attention, next tokens and
generations) or a running server's HTTP API (``server.py``: ``/metrics``, completions) and
add presentation only. ``app.create_app`` is the FastAPI app;
``export.export`` writes the runs and attention pages as static files.
"""

from .app import create_app
from .export import export

__all__ = ["create_app", "export"]
