"""How many CPU threads torch (OpenMP, MKL) may use in this process."""

from __future__ import annotations

import logging
import os
import sys

from scheduler_core.compat import usable_cores

log = logging.getLogger("batchgate.consumer")


def default_torch_threads() -> int | None:
    """`batchgate consumer`'s default: every usable core, unless the user set
    OMP_NUM_THREADS (None: that rules)."""
    return None if os.environ.get("OMP_NUM_THREADS") else usable_cores()


def limit_torch_threads(threads: int | None) -> int | None:
    """Cap torch's CPU threads at `threads` (None: leave them be); the number applied.
    Consumers sharing a host each default to all cores otherwise, and then fight over
    them: two MiniLM consumers on 2 cores serve less than one."""
    if threads is None:
        return None
    # Read by OpenMP and MKL when torch starts; torch already imported is told directly.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.info("torch threads: %d", threads)
    return threads
