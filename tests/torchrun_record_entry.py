"""``python -m tests.torchrun_record_entry`` = ``replayrl.tools.run.torchrun_entry`` with the trainer
and the engines recording every push's weights (``tests.weight_recorders``) into
``$REPLAYRL_TEST_WEIGHTS`` of their host."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from replayrl.tools.run.torchrun_entry import main
from tests.weight_recorders import WEIGHTS_ENV, recording_specs

if __name__ == "__main__":
    sys.exit(main(transform_specs=lambda specs: recording_specs(specs, Path(os.environ[WEIGHTS_ENV]))))
