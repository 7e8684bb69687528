"""The step-wise model contract, for `--batching continuous` (docs/models.md).

A model that generates step by step declares `steps = True` and has three methods:

- `add(payload, cost=None) -> handle`: validate one request and take it into the running
  batch (its prefill runs with the next step). A bad payload raises ValueError (or any
  Exception): that request fails alone and nothing is added. `cost` is the request's
  consumer.batch.Cost when the model also declares `accepts_costs`, else None.
- `step() -> list[Step]`: advance every running sequence by one token (a sequence added
  since the last step runs its prefill and yields its first token). Each sequence that
  advanced appears once: `Step(handle, part, result)`; `part` is what a streaming client
  gets for this step (None: nothing to stream), `result` is the request's whole result
  once it is finished (None while it runs). A finished sequence leaves the running batch
  by itself; the others never wait for it nor recompute for it.
- `remove(handle)`: take a running sequence out before it finishes (its lease was lost,
  or it is preempted); an unknown handle is ignored.

If `step()` raises, every running sequence fails with that error and the consumer goes on
with the next requests (the model must then hold none: `running() == 0`). `running()`
says how many sequences are in the batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable


class Step(NamedTuple):
    handle: Any
    part: Any  # streamed as this step's part (None: nothing to stream)
    result: Any  # the request's result once finished; None while it runs


@runtime_checkable
class StepModel(Protocol):
    steps: bool

    def add(self, payload: Any, cost: Any = None) -> Any: ...

    def step(self) -> list[Step]: ...

    def remove(self, handle: Any) -> None: ...

    def running(self) -> int: ...


class ModelContractError(Exception):
    """A step-wise model broke the contract (step() returned something else)."""


def checked_steps(steps: Any) -> list[Step]:
    """step()'s return as a list of Step, or ModelContractError."""
    try:
        out = [Step(*s) for s in steps]
        for s in out:
            hash(s.handle)
    except TypeError as exc:
        raise ModelContractError(f"step() must return a list of (handle, part, result) "
                                 f"with hashable handles: {exc}") from None
    return out


def is_step_model(model: Any) -> bool:
    """Whether `model` declares the step-wise contract and has its methods."""
    return bool(getattr(model, "steps", False)) and isinstance(model, StepModel)
