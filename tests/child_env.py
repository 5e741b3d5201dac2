"""``PYTHONPATH`` for the processes a test starts: the repository root (so ``tests.*`` helpers
such as ``tests.failing_trainer`` import there) before whatever the suite already set
(tests/conftest.py's folder that makes ``replayrl`` this checkout's)."""
import os

from tests.paths import REPO

PYTHONPATH = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
