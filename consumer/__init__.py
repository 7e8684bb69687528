"""GPU (or CPU) worker processes that pop batches from a queue and run a model on them.

Depends on scheduler_core only. Start one with `batchgate consumer --model MODULE:ATTR`,
or in your own process with `Consumer(model).run()` (consumer/api.py).
"""

from consumer.api import Consumer
from consumer.config import ConsumerConfig
from consumer.loader import load_model

__all__ = ["Consumer", "ConsumerConfig", "load_model"]
