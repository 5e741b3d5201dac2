"""``python -m tests.torchrun_fault_entry`` = ``replayrl.tools.run.torchrun_entry`` with one faulty actor on
this torchrun's ranks (``replayrl.tools.bench.fault_injection.faulty_specs``), named by ``$REPLAYRL_TEST_FAULT`` as
``ACTOR:SIGNAL:CALL:MARKER`` (e.g. ``engine_1:HANG:2:/tmp/fault.json``)."""
from __future__ import annotations

import os
import sys

from replayrl.tools.bench.fault_injection import faulty_specs
from replayrl.tools.run.torchrun_entry import main

FAULT_ENV = "REPLAYRL_TEST_FAULT"

if __name__ == "__main__":
    actor, signal, call, marker = os.environ[FAULT_ENV].split(":", 3)
    sys.exit(main(transform_specs=lambda specs: faulty_specs(specs, actor, signal, int(call),
                                                             marker)))
