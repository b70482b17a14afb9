import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# traced graphs are cached per session, never in the user's home
if "AUTOPAR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-test-cache-")
    atexit.register(shutil.rmtree, os.environ["AUTOPAR_CACHE_DIR"], True)
# the probe readings `autopar execute` appends (``autopar.profile.history``) go to the
# session's folder, not the user's ~/.cache; no plan reads them unless asked (--speed-history)
os.environ.setdefault("AUTOPAR_SPEED_HISTORY", os.path.join(os.environ["AUTOPAR_CACHE_DIR"], "speed_history.json"))


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def profile():
    from fakes import synthetic_profile
    return synthetic_profile()
