"""The byte-level tokenizer the gateway counts OpenAI `usage` with when a model does not
report its own counts: one token per UTF-8 byte. It is the built-in generator's own
tokenizer (consumer.models.decoder: a prompt's UTF-8 bytes are its token ids), so its
counts are exact for it; for other models it is an upper bound of their wordpieces.
"""

from __future__ import annotations


def count(text: str) -> int:
    """Tokens in `text`: its UTF-8 bytes."""
    return len(text.encode("utf-8", errors="surrogatepass"))
