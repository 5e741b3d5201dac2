"""Fixtures of the trainer's unit tests."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank_group():
    """For a module whose fsdp backends make a world-size-1 gloo group in this process: after
    the module, the process's thread count (the backends set it) is restored and the group is
    destroyed. Request it with ``pytestmark = pytest.mark.usefixtures("one_rank_group")``."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    if dist.is_initialized():
        dist.destroy_process_group()
