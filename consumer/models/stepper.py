"""Step-wise greedy decoding for a GPT-2 model (consumer/stepwise.py's contract), with one
KV cache slot per sequence: sequences join and leave the running batch between steps
without recomputing the others.

The caches live in one tensor per layer, (slots, heads, length, head_dim), the running
sequences in slots 0..n-1: a step reads a view of the first n slots, never a copy; a
sequence leaving moves the last slot's cache into its own. Each step decodes one token
for every running sequence in one batched forward, a sequence's attention masked to its
own length; a sequence added since the last step runs its prompt alone (prefill) and
yields its first token in that step.

The forward pass reuses the HF model's own modules (embeddings, layer norms, Conv1D
projections, MLP), with GPT-2's attention (scaled by 1/sqrt(head_dim)), so a sequence's
tokens are those of the model run on it alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention


@dataclass
class Sequence:
    handle: int
    prompt: list[int]
    budget: int
    tokens: list[int] = field(default_factory=list)  # generated so far
    slot: int = -1  # its cache slot once prefilled
    cached: int = 0  # tokens in its cache: the prompt, then all but the last generated


class GPT2Stepper:
    def __init__(self, model: Any, device: torch.device):
        config = model.config
        # The variants of GPT-2's attention this forward pass does not write out.
        if not getattr(config, "scale_attn_weights", True) \
                or getattr(config, "scale_attn_by_inverse_layer_idx", False) \
                or getattr(config, "reorder_and_upcast_attn", False):
            raise ValueError("step-by-step decoding supports GPT-2's standard attention only "
                             "(scale_attn_weights, no scale_attn_by_inverse_layer_idx, no "
                             "reorder_and_upcast_attn)")
        self.transformer, self.lm_head, self.device = model.transformer, model.lm_head, device
        self.heads, self.dim = int(config.n_head), int(config.n_embd)
        self.head_dim = self.dim // self.heads
        self.layers = int(config.n_layer)
        self.positions = int(config.n_positions)
        self.dtype = next(model.parameters()).dtype
        self._ids = itertools.count(1)
        self.waiting: list[Sequence] = []  # added, prefill at the next step
        self.slots: list[Sequence] = []  # running, by cache slot
        self.by_handle: dict[int, Sequence] = {}
        self._capacity = (0, 0)  # (slots, length) of the cache tensors
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def running(self) -> int:
        return len(self.by_handle)

    def add(self, prompt: list[int], budget: int) -> int:
        if len(prompt) + budget > self.positions:
            raise ValueError(f"{len(prompt)} prompt tokens + {budget} new tokens exceed "
                             f"the model's {self.positions} positions")
        seq = Sequence(next(self._ids), list(prompt), budget)
        self.waiting.append(seq)
        self.by_handle[seq.handle] = seq
        return seq.handle

    def remove(self, handle: int) -> None:
        seq = self.by_handle.pop(handle, None)
        if seq is None:
            return
        if seq.slot < 0:
            self.waiting.remove(seq)
            return
        last = self.slots.pop()
        if last is not seq:  # the last slot's sequence moves into the freed one
            n = last.cached
            with torch.inference_mode():  # the caches are inference tensors
                for cache in (*self.keys, *self.values):
                    cache[seq.slot, :, :n] = cache[last.slot, :, :n]
            last.slot = seq.slot
            self.slots[seq.slot] = last
        seq.slot = -1

    def clear(self) -> None:
        for handle in list(self.by_handle):
            self.remove(handle)

    def step(self) -> list[tuple[int, int, list[int] | None]]:
        """One token for every sequence: [(handle, token, all tokens if finished)]."""
        out: list[tuple[int, int, list[int] | None]] = []
        with torch.inference_mode():
            if self.slots:
                tokens = self._decode()
                out += [(seq.handle, token, None)
                        for seq, token in zip(list(self.slots), tokens, strict=True)]
            joining, self.waiting = self.waiting, []
            for seq in joining:
                self._ensure(len(self.slots) + 1, len(seq.prompt) + seq.budget)
                seq.slot = len(self.slots)
                self.slots.append(seq)
                out.append((seq.handle, self._prefill(seq), None))
        finished = []
        for i, (handle, token, _) in enumerate(out):
            seq = self.by_handle[handle]
            seq.tokens.append(token)
            if len(seq.tokens) >= seq.budget:
                out[i] = (handle, token, seq.tokens)
                finished.append(handle)
        for handle in finished:
            self.remove(handle)
        return out

    # -- the forward pass -----------------------------------------------------------
    def _ensure(self, slots: int, length: int) -> None:
        have_slots, have_length = self._capacity
        if slots <= have_slots and length <= have_length:
            return
        new = (max(slots, 2 * have_slots, 4), min(self.positions,
                                                  max(length, 2 * have_length, 64)))
        shape = (new[0], self.heads, new[1], self.head_dim)
        grown: list[torch.Tensor] = []
        for old in (*self.keys, *self.values):
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            cache[:have_slots, :, :have_length] = old
            grown.append(cache)
        if not grown:
            grown = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                     for _ in range(2 * self.layers)]
        self.keys, self.values = grown[:self.layers], grown[self.layers:]
        self._capacity = new

    def _run(self, x: torch.Tensor, write: Any, attend: Any) -> torch.Tensor:
        """The transformer blocks over x (rows, tokens, dim); `write(layer, k, v)` stores
        the new keys and values, `attend(layer, q)` returns the attention output."""
        rows, width = x.shape[0], x.shape[1]
        for layer, block in enumerate(self.transformer.h):
            q, k, v = block.attn.c_attn(block.ln_1(x)).split(self.dim, dim=2)
            q, k, v = (t.view(rows, width, self.heads, self.head_dim).transpose(1, 2)
                       for t in (q, k, v))
            write(layer, k, v)
            a = attend(layer, q).transpose(1, 2).reshape(rows, width, self.dim)
            x = x + block.attn.c_proj(a)
            x = x + block.mlp(block.ln_2(x))
        return self.lm_head(self.transformer.ln_f(x[:, -1, :]))

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(ids) + self.transformer.wpe(positions)

    def _prefill(self, seq: Sequence) -> int:
        n, slot = len(seq.prompt), seq.slot
        ids = torch.tensor([seq.prompt], device=self.device)
        x = self._embed(ids, torch.arange(n, device=self.device)[None])

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.keys[layer][slot, :, :n] = k[0]
            self.values[layer][slot, :, :n] = v[0]

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            return scaled_dot_product_attention(
                q, self.keys[layer][slot:slot + 1, :, :n],
                self.values[layer][slot:slot + 1, :, :n], is_causal=True)

        logits = self._run(x, write, attend)
        seq.cached = n
        return int(logits[0].argmax())

    def _decode(self) -> list[int]:
        seqs = self.slots
        rows = len(seqs)
        at = torch.tensor([s.cached for s in seqs], device=self.device)
        width = int(at.max()) + 1
        last = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)
        x = self._embed(last, at[:, None])
        row = torch.arange(rows, device=self.device)
        # Each row attends to its own cache and its new token, not the padding beyond.
        mask = (torch.arange(width, device=self.device)[None] <= at[:, None])[:, None, None]

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.keys[layer][row, :, at] = k[:, :, 0]
            self.values[layer][row, :, at] = v[:, :, 0]

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            return scaled_dot_product_attention(
                q, self.keys[layer][:rows, :, :width], self.values[layer][:rows, :, :width],
                attn_mask=mask)

        logits = self._run(x, write, attend)
        for s in seqs:
            s.cached += 1
        return logits.argmax(-1).tolist()
