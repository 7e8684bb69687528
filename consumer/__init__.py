"""GPU (or CPU) worker processes that pop batches from a queue and run a model on them.

Depends on scheduler_core only. Start one with `batchgate consumer --model MODULE:ATTR`.
"""

from consumer.loader import load_model
from consumer.worker import Consumer, ConsumerConfig

__all__ = ["Consumer", "ConsumerConfig", "load_model"]
