"""`batchgate profile`: t(b) measured per batch size and fitted to A + B·b, in the form
`batchgate simulate --cost-ms` takes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from batchgate.cli import main
from batchgate.profile_model import fit
from batchgate.simulate import CostModel


def test_least_squares_fit_and_r2():
    line = fit([(1, 5.5), (2, 6.0), (4, 7.0), (8, 9.0)])
    assert (line.base_ms, line.per_item_ms, line.r2) == pytest.approx((5.0, 0.5, 1.0))
    assert CostModel.parse(line.cost_ms) == CostModel(5.0, 0.5)
    noisy = fit([(1, 5.0), (2, 7.0), (3, 6.0)])
    assert 0 < noisy.r2 < 1
    assert fit([(1, 0.0), (2, 0.0)]).r2 == 1.0  # a no-op model: a flat line fits exactly


def test_profile_measures_the_synthetic_model_it_is_told_about():
    result = CliRunner().invoke(main, [
        "profile", "--model", "consumer.models:synthetic", "--model-arg", "base_ms=5",
        "--model-arg", "per_item_ms=1", "--batch-sizes", "1,8,32", "--warmup", "1",
        "--repeat", "7", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [p["batch"] for p in out["points"]] == [1, 8, 32]
    # A sleep of 5 + b ms: never shorter; late by up to ~20 ms on a loaded machine.
    for p in out["points"]:
        assert 5 + p["batch"] <= p["median_ms"] < 5 + p["batch"] + 25
        assert p["error_ms"] == pytest.approx(p["fit_ms"] - p["median_ms"], abs=1e-3)
    f = out["fit"]
    assert f["per_item_ms"] == pytest.approx(1.0, abs=0.35)
    assert f["base_ms"] == pytest.approx(5.0, abs=12)
    assert f["r2"] > 0.8
    CostModel.parse(f["cost_ms"])


@pytest.mark.parametrize(("args", "field"), [
    (["--batch-sizes", "8"], "batch_sizes"),
    (["--batch-sizes", "0,4"], "batch_sizes"),
    (["--batch-sizes", "1,x"], "batch_sizes"),
    (["--payload", "{"], "payload"),
    (["--model", "no_such_module:model"], "--model"),
])
def test_bad_input_names_its_field(args, field):
    result = CliRunner().invoke(main, ["profile", *args])
    assert result.exit_code == 2 and field in result.output, result.output
