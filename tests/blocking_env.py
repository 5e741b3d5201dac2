"""An ``--env`` environment whose ``step`` blocks its thread "forever" (``time.sleep``), the
mistake an ``async def step`` calling blocking code makes; it writes one line to the file
``$REPLAYRL_TEST_STEP_MARK`` as it starts to block, so a test knows the run is inside it."""
from __future__ import annotations

import os
import time

from replayrl.rollout.tasks.calculator import DigitCalculatorEnv


class SleepsForever(DigitCalculatorEnv):
    """The digit calculator, except that every step sleeps an hour before answering."""

    async def step(self, turn):
        """Mark the file, then block this thread for an hour."""
        with open(os.environ["REPLAYRL_TEST_STEP_MARK"], "a") as mark:
            mark.write("step\n")
        time.sleep(3600)
        return await super().step(turn)
