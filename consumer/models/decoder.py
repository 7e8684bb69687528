"""A generative model: a small GPT-2 decoder (transformers' GPT2LMHeadModel) that generates
token by token with a KV cache, a batch at a time (the `generate` extra).

Its weights are built from a seed: nothing is downloaded, so THE TEXT IS MEANINGLESS, but
the compute is real — the same kernels, cache and per-token loop as a trained GPT-2 of
this size, so a request asking for 256 new tokens costs 16x or more one asking for 16
(each step also reads a longer cache; docs/benchmarks.md has the measurement).
`checkpoint=PATH` loads a user's own GPT-2 checkpoint instead (a directory written by
`save_pretrained`, read with `local_files_only=True`).

A batch is generated together: prompts are left-padded to the batch's longest, with an
attention mask and position ids counted from each prompt's first real token, so a
request's tokens do not depend on its batch-mates; the prompt runs once (prefill), then
one token per step for every row, reusing the cache. Decoding is greedy (deterministic);
there is no end-of-text token: each request gets exactly its budget of new tokens, and
the batch runs until its largest budget is spent (finished rows ride along, as in a
padded tensor, but their extra tokens are dropped).

The budget of each request, in this order: the `costs` the runner passes (one per
request), else the payload's `"max_new_tokens"`, else the `max_new_tokens` model argument;
always capped at `max_new_tokens_cap`.

With `stream=true` (a model argument) it streams (`streams`, docs/streaming.md): after
each step, one emit for the whole batch with each unfinished row's new token as
{"token": id, "text": str}; the result is the same as without.

It is also a step-wise model (`steps`, consumer/stepwise.py) for `--batching continuous`:
`add` takes one request into a running batch, `step` advances every sequence one token
(consumer/models/stepper.py keeps one KV cache slot per sequence), and a finished one
leaves with its result, the same result as above.

Tokens: a prompt's UTF-8 bytes are its token ids (0-255); an id decodes to the byte
`id % 256`, so every generated id has a (meaningless) text.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from consumer.models.stepper import GPT2Stepper
from consumer.stepwise import Step

MAX_PROMPT_TOKENS = 512  # as TorchRunner: a long prompt would drag its batch-mates
MAX_PROMPT_CHARS = 4 * MAX_PROMPT_TOKENS  # cheap guard before encoding: 4 bytes per char
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def build_gpt2(vocab: int = 4096, layers: int = 4, dim: int = 256, heads: int = 4,
               positions: int = 1024, seed: int = 0, init_std: float = 0.3) -> Any:
    """A GPT2LMHeadModel with weights drawn from `seed` (the global RNG is left alone).

    `init_std` is wider than GPT-2's 0.02: with 0.02 the untrained logits are so flat that
    greedy decoding repeats one token, and a wrong position or a stale cache would go
    unseen; at 0.3 the output depends on every earlier token and position."""
    from transformers import GPT2Config, GPT2LMHeadModel

    for name, value, low in (("vocab", vocab, 256), ("layers", layers, 1), ("dim", dim, 1),
                             ("heads", heads, 1), ("positions", positions, 2)):
        if not _int(value) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if dim % heads:
        raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
    # No bos/eos/pad ids: generation never stops early, and padding is masked out.
    config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=dim, n_layer=layers,
                        n_head=heads, initializer_range=init_std, bos_token_id=None,
                        eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


class Generator:
    """A batch model: list of {"prompt": str} or {"tokens": [ids]} payloads (optionally
    with "max_new_tokens") -> list of {"tokens", "text", "new_tokens"}.

    It opts into the requests' costs (`accepts_costs`): a request's cost, when above 1, is
    its max_new_tokens, so the scheduler's cost budget and buckets count what it runs."""

    accepts_costs = True
    steps = True  # the step-wise contract too (consumer/stepwise.py)

    def __init__(self, model: Any, device: str = "cpu", max_new_tokens: int = 32,
                 max_new_tokens_cap: int = 256, dtype: str = "float32",
                 warmup_batches: Sequence[int] = (1, 4), warmup_new_tokens: int = 4,
                 stream: bool = False):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if not _int(max_new_tokens_cap) or max_new_tokens_cap < 1:
            raise ValueError(f"max_new_tokens_cap must be an integer >= 1, got "
                             f"{max_new_tokens_cap!r}")
        if not _int(max_new_tokens) or not 1 <= max_new_tokens <= max_new_tokens_cap:
            raise ValueError(f"max_new_tokens must be an integer in [1, max_new_tokens_cap="
                             f"{max_new_tokens_cap}], got {max_new_tokens!r}")
        self.device = torch.device(device)
        self.model = model.to(self.device, DTYPES[dtype]).eval()
        self.vocab = int(self.model.config.vocab_size)
        self.positions = int(self.model.config.n_positions)
        if self.vocab < 256:
            raise ValueError(f"the model's vocabulary ({self.vocab}) is smaller than the 256 "
                             "byte tokens a prompt is made of")
        if self.positions < 2:
            raise ValueError(f"the model has {self.positions} positions; it needs >= 2")
        if not isinstance(stream, bool):
            raise ValueError(f"stream must be true or false, got {stream!r}")
        self.streams = stream  # emit each step's tokens (consumer/streaming.py)
        self.max_new_tokens = max_new_tokens
        self.cap = max_new_tokens_cap
        # transformers 5 calls the KV cache `cache`; 4.x called it `past_key_values`.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # Only the last position's logits are needed: skips a (rows x prompt x vocab) matmul.
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        try:
            self._stepper: GPT2Stepper | None = GPT2Stepper(self.model, self.device)
        except ValueError:  # a checkpoint with another attention: batches only
            self._stepper, self.steps = None, False
        self.warm_up(warmup_batches, warmup_new_tokens)

    # -- the edge ---------------------------------------------------------------------------
    def prompt_ids(self, i: int, payload: Any) -> list[int]:
        if not isinstance(payload, dict):
            raise ValueError(f"payload {i}: expected an object with 'prompt' (str) or "
                             "'tokens' ([int, ...])")
        if ("prompt" in payload) == ("tokens" in payload):
            raise ValueError(f"payload {i}: give exactly one of 'prompt' (str) and 'tokens' "
                             "([int, ...])")
        if "prompt" in payload:
            prompt = payload["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"payload {i}: 'prompt' must be a non-empty string")
            if len(prompt) > MAX_PROMPT_CHARS:
                raise ValueError(f"payload {i}: 'prompt' has {len(prompt)} characters, over "
                                 f"the cap of {MAX_PROMPT_TOKENS} tokens")
            ids = list(prompt.encode("utf-8"))
            field = "prompt"
        else:
            ids = payload["tokens"]
            if not isinstance(ids, list) or not ids:
                raise ValueError(f"payload {i}: 'tokens' must be a non-empty list of ids")
            if not all(_int(t) and 0 <= t < self.vocab for t in ids):
                raise ValueError(f"payload {i}: 'tokens' must be integers in "
                                 f"[0, {self.vocab})")
            field = "tokens"
        if len(ids) > MAX_PROMPT_TOKENS:
            raise ValueError(f"payload {i}: '{field}' is {len(ids)} tokens, over the cap of "
                             f"{MAX_PROMPT_TOKENS}")
        return ids

    def budget(self, i: int, payload: Any, cost: int | None) -> int:
        # A cost of 1 is the default of a request that set none: the payload's
        # max_new_tokens (or the model's default) applies then.
        if cost is not None:
            if not _int(cost) or cost < 1:
                raise ValueError(f"payload {i}: cost must be an integer >= 1, got {cost!r}")
            if cost > 1:
                return min(cost, self.cap)
        wanted = payload.get("max_new_tokens", self.max_new_tokens)
        if not _int(wanted) or wanted < 1:
            raise ValueError(f"payload {i}: 'max_new_tokens' must be an integer >= 1, got "
                             f"{wanted!r}")
        return min(wanted, self.cap)

    def requests(self, payloads: list[Any],
                 costs: Sequence[int] | None) -> list[tuple[list[int], int]]:
        if costs is not None and len(costs) != len(payloads):
            raise ValueError(f"{len(costs)} costs for a batch of {len(payloads)}")
        out = []
        for i, p in enumerate(payloads):
            ids = self.prompt_ids(i, p)
            n = self.budget(i, p, None if costs is None else costs[i])
            if len(ids) + n > self.positions:
                raise ValueError(f"payload {i}: {len(ids)} prompt tokens + {n} new tokens "
                                 f"exceed the model's {self.positions} positions")
            out.append((ids, n))
        return out

    # -- the model --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], budgets: list[int],
                 emit: Callable[[dict[int, Any]], None] | None = None) -> list[list[int]]:
        """Greedy generation of budgets[i] tokens after prompts[i], all rows together;
        `emit`, if given, gets each step's new tokens of the rows still within budget."""
        rows, longest, steps = len(prompts), max(map(len, prompts)), max(budgets)
        ids = torch.zeros((rows, longest), dtype=torch.long)
        mask = torch.zeros((rows, longest), dtype=torch.long)
        for r, prompt in enumerate(prompts):  # left padding: every row ends at its last token
            ids[r, longest - len(prompt):] = torch.tensor(prompt)
            mask[r, longest - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Positions count real tokens only, so a padded prompt sees the positions it would
        # see alone; pads get 0 (masked out anyway).
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        new = torch.empty((rows, steps), dtype=torch.long, device=self.device)
        cache = None
        with torch.inference_mode():
            for step in range(steps):
                kwargs = {} if cache is None else {self._cache_arg: cache}
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                 use_cache=True, **self._last_only, **kwargs)
                cache = getattr(out, self._cache_arg)
                ids = out.logits[:, -1, :].argmax(-1, keepdim=True)
                new[:, step] = ids[:, 0]
                if emit is not None:
                    tokens = ids[:, 0].tolist()
                    emit({r: {"token": t, "text": chr(t % 256)}
                          for r, t in enumerate(tokens) if step < budgets[r]})
                mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
                positions = positions[:, -1:] + 1
        generated = new.cpu().tolist()
        return [row[:n] for row, n in zip(generated, budgets, strict=True)]

    def warm_up(self, batch_sizes: Sequence[int], new_tokens: int) -> None:
        """A few generations before traffic: the first calls allocate and pick kernels."""
        length = min(8, self.positions - 1)
        steps = max(1, min(new_tokens, self.positions - length))
        for size in batch_sizes:
            self.generate([[1] * length] * size, [steps] * size)
        if batch_sizes and self._stepper is not None:  # the step-wise path's kernels
            for _ in range(max(batch_sizes)):
                self._stepper.add([1] * length, steps)
            while self._stepper.running():
                self._stepper.step()

    # -- step by step (consumer/stepwise.py) ----------------------------------------------
    def add(self, payload: Any, cost: int | None = None) -> int:
        [(ids, n)] = self.requests([payload], None if cost is None else [cost])
        return self._stepper.add(ids, n)

    def step(self) -> list[Step]:
        steps = []
        for handle, token, tokens in self._stepper.step():
            part = {"token": token, "text": chr(token % 256)} if self.streams else None
            steps.append(Step(handle, part, None if tokens is None else _result(tokens)))
        return steps

    def remove(self, handle: Any) -> None:
        self._stepper.remove(handle)

    def running(self) -> int:
        return self._stepper.running()

    def __call__(self, payloads: list[Any], costs: list[int] | None = None,
                 emit: Callable[[dict[int, Any]], None] | None = None) -> list[dict[str, Any]]:
        requests = self.requests(payloads, costs)  # all validated before anything runs
        if not requests:
            return []
        prompts, budgets = [r[0] for r in requests], [r[1] for r in requests]
        return [_result(tokens) for tokens in self.generate(prompts, budgets, emit)]


def _result(tokens: list[int]) -> dict[str, Any]:
    text = bytes(t % 256 for t in tokens).decode("utf-8", errors="replace")
    return {"tokens": tokens, "text": text, "new_tokens": len(tokens)}


def load_checkpoint(path: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import GPT2LMHeadModel

    if not os.path.isdir(path):
        raise ValueError(f"checkpoint {path!r} is not a directory (save_pretrained writes one)")
    return GPT2LMHeadModel.from_pretrained(path, local_files_only=True)
