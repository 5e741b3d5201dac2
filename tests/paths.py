"""Where the suite's fixed files are, for tests at any depth: the repository root and the
acceptance cases copied unchanged from ``shared/cases/``."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = REPO / "tests" / "cases"
