"""paper_cost: GPU-hours of a spec's runs at paper scale from the FLOP count, and the memory plan's verdict."""

from __future__ import annotations

import json

import pytest

from pretrain.research import paper_cost
from pretrain.runtime.accounting import flops_per_token


@pytest.mark.slow  # the memory plan builds each distinct model on the meta device: seconds
def test_core_costs_its_tokens_times_the_flop_count_over_the_throughput(capsys):
    assert paper_cost.main(["--specs", "core", "--gpu", "H100 SXM", "--mfu", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (core,) = report["specs"]
    tokens = 100_000 * 128 * 512  # the Small preset: steps × global batch × sequence length
    assert (core["runs"], core["gpus_per_run"], core["tokens_per_run"]) == (15, 8, [tokens, tokens])
    assert core["runs_that_fit"] == 15  # Small on 8 × 80 GB

    spec = paper_cost.load_spec(paper_cost.EXPERIMENTS / "core.yaml")
    runs = paper_cost.expand(spec, "paper", None, [], paper_cost.Path("unused"))
    expected = sum(tokens * flops_per_token(run.cfg.model) for run in runs) / (989.5e12 * 0.5) / 3600
    assert core["gpu_hours"] == pytest.approx(expected)
    # frozen Q/K skip their weight gradients: ORA's runs are the cheapest, vanilla's the dearest
    vanilla = next(r for r in runs if r.arm == "vanilla").cfg.model
    ora = next(r for r in runs if r.arm == "ora").cfg.model
    per_hour = 989.5e12 * 0.5 * 3600
    assert core["gpu_hours_per_run"] == pytest.approx([tokens * flops_per_token(ora) / per_hour,
                                                       tokens * flops_per_token(vanilla) / per_hour])


@pytest.mark.parametrize("mfu", ["0", "1.5", "nan"])
def test_an_mfu_outside_0_1_exits_2(capsys, mfu):
    assert paper_cost.main(["--specs", "core", "--mfu", mfu]) == 2
    assert "--mfu" in capsys.readouterr().err
