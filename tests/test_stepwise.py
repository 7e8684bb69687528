"""The step-wise contract (consumer/stepwise.py) of `consumer.models:generator` (issue 36
§1): requests join and leave a running batch at different steps, each with its own KV
cache slot, and each request's greedy output equals the same request generated alone;
one token per running sequence per step; a removed sequence frees its slot without
disturbing the others; bad payloads fail alone, naming the field."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_generator import one_thread  # noqa: E402, F401  (autouse: one torch thread)

from consumer.models.decoder import Generator, build_gpt2  # noqa: E402
from consumer.stepwise import is_step_model  # noqa: E402

TINY = {"vocab": 512, "layers": 2, "dim": 32, "heads": 2, "positions": 128}


def tiny(**kwargs) -> Generator:
    kwargs.setdefault("warmup_batches", ())
    return Generator(build_gpt2(**TINY, seed=3), **kwargs)


def alone(model: Generator, payload: dict) -> list[int]:
    return model([payload])[0]["tokens"]


PAYLOADS = [{"prompt": "Hello, world", "max_new_tokens": 12},
            {"tokens": [7, 300, 41, 5, 511, 2, 99, 18, 250, 3, 77, 64, 120, 1, 9],
             "max_new_tokens": 30},
            {"prompt": "é", "max_new_tokens": 1},
            {"tokens": [42], "max_new_tokens": 21},
            {"prompt": "a longer prompt than the others, to pad them", "max_new_tokens": 7},
            {"prompt": "late", "max_new_tokens": 16}]
JOIN_AT = [0, 0, 3, 5, 5, 20]  # the step before which each request is added


def run_continuous(model: Generator, payloads, join_at, remove: dict | None = None):
    """Steps until every request is done; returns ({request: tokens}, tokens per step)."""
    remove = remove or {}
    handles, tokens, finished, per_step = {}, {}, {}, []
    step = 0
    while len(finished) + len(remove) < len(payloads) or model.running():
        for i, at in enumerate(join_at):
            if at == step:
                handles[model.add(payloads[i])] = i
        for i, at in remove.items():
            if at == step:
                h = next(h for h, j in handles.items() if j == i)
                model.remove(h)
        out = model.step()
        per_step.append(len(out))
        seen = set()
        for s in out:
            i = handles[s.handle]
            assert i not in seen and i not in finished, "one token per sequence per step"
            seen.add(i)
            tokens.setdefault(i, []).append(s.part["token"])
            if s.result is not None:
                finished[i] = s.result
        step += 1
    for i, result in finished.items():
        assert result["tokens"] == tokens[i]
        assert result["new_tokens"] == len(tokens[i])
    return finished, per_step


def test_joining_and_leaving_at_different_steps_gives_each_request_its_solo_output():
    model = tiny(stream=True)
    assert is_step_model(model)
    finished, per_step = run_continuous(model, PAYLOADS, JOIN_AT)
    for i, payload in enumerate(PAYLOADS):
        assert finished[i]["tokens"] == alone(model, payload), f"request {i}"
        assert len(finished[i]["tokens"]) == payload["max_new_tokens"]
    # Request 1 (30 tokens, from step 0) runs to step 29: the batch never waits for it.
    assert len(per_step) == 36  # request 5 joins at step 20 and needs 16 steps
    assert per_step[0] == 2 and per_step[3] == 3  # request 2 joined and left at step 3
    assert model.running() == 0


def test_a_removed_sequence_leaves_the_others_untouched():
    model = tiny(stream=True)
    finished, _ = run_continuous(model, PAYLOADS, JOIN_AT, remove={1: 8, 3: 6})
    assert set(finished) == {0, 2, 4, 5}
    for i in finished:
        assert finished[i]["tokens"] == alone(model, PAYLOADS[i]), f"request {i}"
    assert model.running() == 0


def test_the_cache_grows_as_sequences_join():
    model = tiny(stream=True)
    many = [{"tokens": [i + 1, 2 * i + 3], "max_new_tokens": 3 + i} for i in range(11)]
    finished, _ = run_continuous(model, many, [i // 2 for i in range(11)])
    for i, payload in enumerate(many):
        assert finished[i]["tokens"] == alone(model, payload), f"request {i}"


def test_without_stream_the_steps_carry_no_part_and_the_cost_sets_the_budget():
    model = tiny()
    handle = model.add({"prompt": "x", "max_new_tokens": 2}, cost=5)
    steps = [model.step() for _ in range(5)]
    assert [len(s) for s in steps] == [1] * 5
    assert all(s[0].part is None for s in steps)
    assert steps[-1][0].result["new_tokens"] == 5 and steps[-1][0].handle == handle
    assert model.step() == []


@pytest.mark.parametrize("payload, message", [
    ({"prompt": "x", "max_new_tokens": -1}, "'max_new_tokens' must be an integer >= 1"),
    ({"prompt": "x", "max_new_tokens": 0}, "'max_new_tokens' must be an integer >= 1"),
    ({"tokens": [1, 99999]}, "'tokens' must be integers"),
    ({"prompt": "x" * 120, "max_new_tokens": 20}, "exceed the model's 128 positions"),
    ("not an object", "expected an object"),
])
def test_a_bad_payload_is_refused_at_add_and_nothing_joins(payload, message):
    model = tiny()
    model.add({"prompt": "ok", "max_new_tokens": 3})
    with pytest.raises(ValueError, match=message):
        model.add(payload)
    assert model.running() == 1
    assert [len(model.step()) for _ in range(3)] == [1, 1, 1]
    assert model.running() == 0


def test_a_checkpoint_with_another_attention_runs_batches_only():
    """A GPT-2 variant the step-wise forward pass does not write out is not offered as
    step-wise (--batching continuous then refuses it at start); batches still run."""
    model = build_gpt2(**TINY, seed=3)
    model.config.scale_attn_by_inverse_layer_idx = True
    generator = Generator(model, warmup_batches=())
    assert not is_step_model(generator)
    assert generator([{"prompt": "x", "max_new_tokens": 2}])[0]["new_tokens"] == 2
