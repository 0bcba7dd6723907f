import os
from pathlib import Path

import blockformer  # noqa: F401 - first: under ATEN_CPU_CAPABILITY it gives inductor that cap's own cache
import pytest
import torch

torch.set_num_threads(int(os.environ.get("BLOCKFORMER_TEST_THREADS", "2")))

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("BLOCKFORMER_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip: no test may need the shared data sets."""
    if not DATA.is_dir():
        pytest.skip(f"shared data not found at {DATA}")
    return DATA
