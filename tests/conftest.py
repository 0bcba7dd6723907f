import getpass
import os
import tempfile
from pathlib import Path

# Inductor's on-disk cache does not key its kernels by ATEN_CPU_CAPABILITY: kernels compiled
# under the AVX2 cap (make test-avx2) and loaded by a native run, or the other way round, abort
# or compute wrongly. Each capability gets its own cache.
if os.environ.get("ATEN_CPU_CAPABILITY"):
    _base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{_base}-{os.environ['ATEN_CPU_CAPABILITY'].lower()}"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("BLOCKFORMER_TEST_THREADS", "2")))

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("BLOCKFORMER_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip: no test may need the shared data sets."""
    if not DATA.is_dir():
        pytest.skip(f"shared data not found at {DATA}")
    return DATA
