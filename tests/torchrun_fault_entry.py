"""``python -m tests.torchrun_fault_entry`` = ``tools.torchrun_entry`` with one faulty actor on
this torchrun's ranks (``tools.faults.faulty_specs``), named by ``$REPLAYRL_TEST_FAULT`` as
``ACTOR:SIGNAL:CALL:MARKER`` (e.g. ``engine_1:HANG:2:/tmp/fault.json``)."""
from __future__ import annotations

import os
import sys

from tools.faults import faulty_specs
from tools.torchrun_entry import main

FAULT_ENV = "REPLAYRL_TEST_FAULT"

if __name__ == "__main__":
    actor, signal, call, marker = os.environ[FAULT_ENV].split(":", 3)
    sys.exit(main(transform_specs=lambda specs: faulty_specs(specs, actor, signal, int(call),
                                                             marker)))
