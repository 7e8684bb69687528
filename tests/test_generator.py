"""`consumer.models:generator` (issue 16 §5): a seeded GPT-2 decoder generating a padded
batch with a KV cache. Batched output equals each request alone and a cache-less
reference; each request gets its own budget (costs, then the payload's max_new_tokens,
then the default), capped; bad payloads fail naming the field before anything runs; a
saved checkpoint loads back to the same outputs; the warm-up runs; and the model serves
through a real `batchgate consumer`. A tiny config keeps a batch to tens of ms on a CPU."""

from __future__ import annotations

import pytest

from producer import Producer, RequestFailed

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from consumer.models import generator  # noqa: E402
from consumer.models.decoder import MAX_PROMPT_TOKENS, Generator, build_gpt2  # noqa: E402

TINY = {"vocab": 512, "layers": 2, "dim": 32, "heads": 2, "positions": 128}
TINY_ARGS = [a for k, v in TINY.items() for a in ("--model-arg", f"{k}={v}")]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: the host is shared, and two spinning threads slow a tiny model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(seed: int = 0, **kwargs) -> Generator:
    kwargs.setdefault("warmup_batches", ())
    return Generator(build_gpt2(**TINY, seed=seed), **kwargs)


def count_forwards(model) -> list[tuple[int, ...]]:
    """The input_ids shape of every forward call of `model` from now on."""
    shapes: list[tuple[int, ...]] = []
    model.register_forward_hook(
        lambda _m, _args, kwargs, _out: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True)
    return shapes


def reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding the slow way: no padding, no cache, the whole sequence every step."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


PAYLOADS = [{"prompt": "Hello, world", "max_new_tokens": 12},
            {"tokens": [7, 300, 41, 5, 511, 2, 99, 18, 250, 3, 77, 64, 120, 1, 9, 400, 8, 31],
             "max_new_tokens": 30},
            {"prompt": "é", "max_new_tokens": 5},
            {"tokens": [42], "max_new_tokens": 21}]


def test_a_padded_batch_with_a_kv_cache_equals_each_request_alone_and_the_reference():
    model = tiny()
    batched = model(PAYLOADS)
    alone = [model([p])[0] for p in PAYLOADS]
    assert batched == alone  # left padding, mask and positions: batch-mates change nothing
    for p, got in zip(PAYLOADS, batched, strict=True):
        prompt = p["tokens"] if "tokens" in p else list(p["prompt"].encode())
        assert got["tokens"] == reference(model.model, prompt, p["max_new_tokens"])
    # Not one id repeated: the tokens depend on what came before, so errors would show.
    assert len({t for r in batched for t in r["tokens"]}) > 10
    # Greedy and seeded: the same model again gives the same tokens, another seed does not.
    assert tiny()(PAYLOADS) == batched
    assert tiny(seed=1)(PAYLOADS) != batched


def test_each_request_stops_at_its_own_budget_and_the_batch_at_the_longest():
    model = tiny()
    forwards = count_forwards(model.model)
    payloads = [{"prompt": "a", "max_new_tokens": 1}, {"prompt": "bcd", "max_new_tokens": 17},
                {"tokens": [5, 6], "max_new_tokens": 4}]
    results = model(payloads)
    assert [r["new_tokens"] for r in results] == [1, 17, 4]
    assert [len(r["tokens"]) for r in results] == [1, 17, 4]
    # One prefill over the padded prompts, then one token per step until the longest is done.
    assert forwards == [(3, 3)] + [(3, 1)] * 16
    for r in results:
        assert r["text"] == bytes(t % 256 for t in r["tokens"]).decode("utf-8", "replace")


def test_the_budget_comes_from_costs_then_the_payload_then_the_default_capped():
    model = tiny(max_new_tokens=6, max_new_tokens_cap=20)
    plain, asks = {"prompt": "x"}, {"prompt": "x", "max_new_tokens": 9}
    assert [r["new_tokens"] for r in model([plain, asks])] == [6, 9]
    assert [r["new_tokens"] for r in model([plain, asks], costs=[3, 2])] == [3, 2]
    # The cap holds whatever asks: a payload, a cost.
    over = [{"prompt": "x", "max_new_tokens": 1000}, plain]
    assert [r["new_tokens"] for r in model(over, costs=None)] == [20, 6]
    assert [r["new_tokens"] for r in model([plain, plain], costs=[500, 20])] == [20, 20]
    # A capped request is the uncapped one cut short: the same first tokens.
    long = tiny(max_new_tokens_cap=40)([{"prompt": "x", "max_new_tokens": 40}])[0]
    assert model([over[0]])[0]["tokens"] == long["tokens"][:20]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_new_tokens": 0}, r"max_new_tokens must be an integer in \[1, "
                            r"max_new_tokens_cap=256\], got 0"),
    ({"max_new_tokens": 300}, r"max_new_tokens must be .* got 300"),
    ({"max_new_tokens_cap": 0}, r"max_new_tokens_cap must be an integer >= 1, got 0"),
    ({"dtype": "int8"}, r"dtype must be one of float32, float16, bfloat16, got 'int8'"),
])
def test_bad_model_arguments_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kwargs)


@pytest.mark.parametrize(("payload", "message"), [
    ({"prompt": ""}, r"payload 1: 'prompt' must be a non-empty string"),
    ({"prompt": 5}, r"payload 1: 'prompt' must be a non-empty string"),
    ({"prompt": "x" * 513}, r"payload 1: 'prompt' is 513 tokens, over the cap of 512"),
    ({"tokens": []}, r"payload 1: 'tokens' must be a non-empty list of ids"),
    ({"tokens": [1, 512]}, r"payload 1: 'tokens' must be integers in \[0, 512\)"),
    ({"tokens": [1, True]}, r"payload 1: 'tokens' must be integers in \[0, 512\)"),
    ({"tokens": [1] * 513}, r"payload 1: 'tokens' is 513 tokens, over the cap of 512"),
    ({"prompt": "a", "tokens": [1]}, r"payload 1: give exactly one of 'prompt' .* 'tokens'"),
    ({"text": "a"}, r"payload 1: give exactly one of 'prompt' .* 'tokens'"),
    ([1, 2], r"payload 1: expected an object with 'prompt'"),
    ({"prompt": "a", "max_new_tokens": 0}, r"payload 1: 'max_new_tokens' must be an integer "
                                           r">= 1, got 0"),
    ({"prompt": "a", "max_new_tokens": "8"}, r"payload 1: 'max_new_tokens' must be .* '8'"),
    ({"tokens": [1] * 100, "max_new_tokens": 29}, r"payload 1: 100 prompt tokens \+ 29 new "
                                                  r"tokens exceed the model's 128 positions"),
])
def test_a_bad_payload_fails_naming_the_field_before_anything_runs(payload, message):
    model = tiny()
    forwards = count_forwards(model.model)
    with pytest.raises(ValueError, match=message):
        model([{"prompt": "fine"}, payload])
    assert forwards == []
    assert MAX_PROMPT_TOKENS == 512


def test_bad_costs_are_refused():
    model = tiny()
    with pytest.raises(ValueError, match=r"1 costs for a batch of 2"):
        model([{"prompt": "a"}, {"prompt": "b"}], costs=[3])
    with pytest.raises(ValueError, match=r"payload 0: cost must be an integer >= 1, got 0"):
        model([{"prompt": "a"}], costs=[0])


def test_the_warm_up_generates_before_traffic():
    seeded = build_gpt2(**TINY)
    forwards = count_forwards(seeded)
    Generator(seeded)  # default warm-up: batches of 1 and 4, 8-token prompts, 4 new tokens
    assert forwards == [(1, 8)] + [(1, 1)] * 3 + [(4, 8)] + [(4, 1)] * 3
    assert not seeded.training


def test_a_saved_checkpoint_loads_back_to_the_same_outputs(tmp_path):
    build_gpt2(**TINY, seed=3).save_pretrained(tmp_path)
    loaded = generator(checkpoint=str(tmp_path))
    assert loaded.vocab == 512 and loaded.positions == 128  # the checkpoint's config
    assert loaded(PAYLOADS) == tiny(seed=3)(PAYLOADS)
    with pytest.raises(ValueError, match=r"checkpoint '.*missing' is not a directory"):
        generator(checkpoint=str(tmp_path / "missing"))


def test_the_factory_builds_the_seeded_model_from_its_arguments():
    model = generator(**TINY, max_new_tokens=3)
    config = model.model.config
    assert (config.vocab_size, config.n_layer, config.n_embd, config.n_head,
            config.n_positions) == (512, 2, 32, 2, 128)
    assert model([{"prompt": "hi"}]) == tiny(max_new_tokens=3)([{"prompt": "hi"}])
    with pytest.raises(ValueError, match=r"dim 30 is not a multiple of heads 4"):
        generator(dim=30, heads=4)
    with pytest.raises(ValueError, match=r"vocab must be an integer >= 256, got 100"):
        generator(vocab=100)


def test_an_empty_batch_runs_nothing():
    model = tiny()
    forwards = count_forwards(model.model)
    assert model([]) == [] and model([], costs=[]) == []
    assert forwards == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_the_generator_runs_on_a_gpu():
    model = tiny(device="cuda", warmup_batches=(1, 4))
    assert all(p.device.type == "cuda" for p in model.model.parameters())
    results = model(PAYLOADS)
    assert [r["new_tokens"] for r in results] == [12, 30, 5, 21]
    assert all(0 <= t < 512 for r in results for t in r["tokens"])


def test_the_generator_through_a_consumer(shared_redis, queue, start_consumer):
    """Served by `batchgate consumer` as the CLI starts it: the same tokens as in process,
    batched; a bad payload fails alone, naming its field."""
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:generator",
                   *TINY_ARGS, "--model-arg", "max_new_tokens=7", "--device", "cpu",
                   "--strategy", "dynamic", "--max-batch-size", "5",
                   "--max-queue-delay-ms", "300", "--torch-threads", "1")
    payloads = [*PAYLOADS, {"tokens": [1, 600]}, {"prompt": "default budget"}]
    with Producer(shared_redis.url, queue) as p:
        handles = p.submit_many(payloads)
        with pytest.raises(RequestFailed, match=r"'tokens' must be integers in \[0, 512\)") \
                as info:
            handles[4].result(timeout=60)
        assert info.value.error_type == "ValueError"
        served = [h.result(timeout=60) for i, h in enumerate(handles) if i != 4]
    good = [p for i, p in enumerate(payloads) if i != 4]
    assert served == tiny(max_new_tokens=7)(good)
    assert [r["new_tokens"] for r in served] == [12, 30, 5, 21, 7]
    # The request's cost is its budget: the scheduler counts what the generator runs.
    with Producer(shared_redis.url, queue) as p:
        costed = p.submit({"prompt": "costed"}, cost=9).result(timeout=60)
        default = p.submit({"prompt": "costed"}, cost=1).result(timeout=60)
    assert costed["new_tokens"] == 9 and default["new_tokens"] == 7


def test_the_factory_stays_the_package_attribute_once_the_model_module_is_loaded():
    """`--model consumer.models:generator` must name the factory however often it ran
    (importing a submodule of the same name would replace the package attribute)."""
    import consumer.models
    import consumer.models.decoder  # noqa: F401

    generator(**TINY)
    assert consumer.models.generator is generator and callable(consumer.models.generator)
