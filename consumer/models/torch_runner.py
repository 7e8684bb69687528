"""Runs a torch module on batches of token-id payloads (needs the `torch` extra).

What keeps a GPU consumer's tail short (docs/scheduling.md, "Where tail latency comes
from"): the model is moved to its device once, runs under `torch.inference_mode()`,
inputs of different lengths are padded to the batch's longest (never to a global maximum:
padding amplifies the tail), over-long inputs are rejected at a hard cap, and dummy
batches warm the kernels up before traffic.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MAX_TOKENS = 512  # hard cap on input length: long inputs would drag their batch-mates


class TinyTextClassifier(nn.Module):
    """Embedding -> masked mean pool -> MLP. Small enough for CPU tests, built in code."""

    def __init__(self, vocab: int, classes: int, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, classes))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        emb = self.embed(tokens) * mask.unsqueeze(-1)
        pooled = emb.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return self.mlp(pooled).softmax(-1)


def build_tiny_text_model(vocab: int = 1000, classes: int = 4, seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():  # seeded weights without touching the global RNG
        torch.manual_seed(seed)
        return TinyTextClassifier(vocab, classes)


class TorchRunner:
    """A batch model: list of {"tokens": [...]} payloads -> list of probability lists."""

    def __init__(self, module: nn.Module, device: str = "cpu", vocab: int = 1000,
                 warmup_batches: tuple[int, ...] = (1, 8, 32), warmup_len: int = 16):
        self.device = torch.device(device)
        self.vocab = vocab
        self.module = module.to(self.device).eval()
        self.warm_up(warmup_batches, warmup_len)

    def collate(self, payloads: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for i, p in enumerate(payloads):
            tokens = p.get("tokens") if isinstance(p, dict) else None
            if not isinstance(tokens, list) or not tokens:
                raise ValueError(f"payload {i}: expected {{'tokens': [int, ...]}}")
            if len(tokens) > MAX_TOKENS:
                raise ValueError(f"payload {i}: {len(tokens)} tokens, over the cap of "
                                 f"{MAX_TOKENS}")
            if not all(isinstance(t, int) and 0 < t < self.vocab for t in tokens):
                raise ValueError(f"payload {i}: token ids must be integers in [1, {self.vocab})")
            rows.append(tokens)
        longest = max(len(r) for r in rows)
        tokens = torch.zeros((len(rows), longest), dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.float32)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        return tokens.to(self.device), mask.to(self.device)

    def warm_up(self, batch_sizes: tuple[int, ...], length: int) -> None:
        for size in batch_sizes:
            self([{"tokens": [1] * length}] * size)

    def __call__(self, payloads: list[Any]) -> list[list[float]]:
        tokens, mask = self.collate(payloads)
        with torch.inference_mode():
            probs = self.module(tokens, mask)
        return probs.float().cpu().tolist()
