"""pretrain.research.report on sweeps built through the RunDir API, with answers known by hand."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest
import yaml
from scipy import stats
from sweep_runs import train_record, valid_record, write_evaluation, write_run

from pretrain.research.report import plots
from pretrain.research.report.__main__ import main
from pretrain.research.report.build import build_report, layer_plot_name, revisions_text
from pretrain.research.report.gaps import run_x, verdict
from pretrain.research.report.latex import write_latex
from pretrain.research.report.runs import (
    ReportError,
    SweepRun,
    exclusion_reason,
    last_k_variance,
    latest_per_step,
    mean_loss_over_curve,
    read_evaluation,
    steps_to_target,
    training_seconds_until,
)
from pretrain.research.report.stats import compare_paired, holm, log_trend, power_trend
from pretrain.research.report.tables import Column, Table, fixed, mean_std, plain
from pretrain.research.sweep.spec import GapsSpec
from pretrain.run_files.run_dir import RunDir

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- statistics


def test_holm_textbook_example():
    # sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → raised to 0.06 (monotone)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])


def test_holm_keeps_na_out_of_the_family_and_caps_at_one():
    assert holm([0.02, None, 0.6]) == pytest.approx([0.04, None, 0.6])
    assert holm([0.5, 0.7]) == [1.0, 1.0]


def test_paired_tests_against_hand_values_when_the_arm_is_worse():
    reference = {42: 3.0, 2024: 3.1, 12345: 3.2, 98765: 3.3, 555666: 3.4}
    differences = {42: 0.1, 2024: 0.2, 12345: 0.3, 98765: 0.4, 555666: 0.5}
    arm = {seed: reference[seed] + differences[seed] for seed in reference}
    result = compare_paired(arm, reference)
    # t = mean / (sd / sqrt(n)) = 0.3 / (sqrt(0.025) / sqrt(5)) = sqrt(18), 4 degrees of freedom.
    t = 0.3 / (math.sqrt(0.025) / math.sqrt(5))
    assert t == pytest.approx(math.sqrt(18))
    assert result.pairs == 5 and result.mean_difference == pytest.approx(0.3)
    assert result.t_test_p == pytest.approx(2 * stats.t.sf(t, df=4))
    assert result.t_test_p == pytest.approx(0.0132356, abs=1e-6)
    # Every difference positive: W− = 0, exact two-sided p = 2 · P(W ≤ 0) = 2/2^5.
    assert result.wilcoxon_p == pytest.approx(2 / 32)
    assert result.cohens_dz == pytest.approx(0.3 / math.sqrt(0.025))
    assert result.note == ""


def test_wilcoxon_with_mixed_signs_and_the_sign_of_the_difference():
    reference = {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0, 5: 2.0}
    arm = {1: 1.5, 2: 2.1, 3: 1.7, 4: 1.8, 5: 1.6}  # differences −0.5, +0.1, −0.3, −0.2, −0.4
    result = compare_paired(arm, reference)
    assert result.mean_difference == pytest.approx(-0.26)  # the arm's loss is lower
    # |d| ranks 5, 1, 3, 2, 4: W+ = 1; subsets of 1..5 with rank sum ≤ 1 are {} and {1}: p = 2 · 2/32.
    assert result.wilcoxon_p == pytest.approx(0.125)
    assert result.t_test_p == pytest.approx(stats.ttest_rel(list(arm.values()), list(reference.values())).pvalue)


def test_cohens_dz_by_hand():
    result = compare_paired({1: 11.0, 2: 12.0, 3: 13.0}, {1: 10.0, 2: 10.0, 3: 10.0})
    # differences 1, 2, 3: mean 2, sample std 1
    assert result.cohens_dz == pytest.approx(2.0)


def test_one_pair_is_na_and_unpaired_seeds_are_left_out():
    result = compare_paired({42: 3.5, 7: 3.0}, {42: 3.25, 8: 3.0})
    assert result.pairs == 1 and result.mean_difference == 0.25
    assert (result.t_test_p, result.wilcoxon_p, result.cohens_dz) == (None, None, None)
    assert result.note == "fewer than two paired seeds"


def test_equal_differences_leave_the_t_test_undefined():
    result = compare_paired({1: 3.25, 2: 3.75, 3: 4.25}, {1: 3.0, 2: 3.5, 3: 4.0})
    assert result.t_test_p is None and result.cohens_dz is None
    assert "zero variance" in result.note
    assert result.wilcoxon_p == pytest.approx(0.25)  # all three differences positive (tied ranks)
    zeros = compare_paired({1: 3.0, 2: 3.5}, {1: 3.0, 2: 3.5})
    assert zeros.wilcoxon_p is None and "all differences zero" in zeros.note


# ---------------------------------------------------------------------------- curves


def test_steps_and_training_time_to_target():
    valid = [valid_record(10, 3.0), valid_record(25, 2.4), valid_record(40, 2.6), valid_record(50, 2.0)]
    assert steps_to_target(valid, 2.5) == 25
    assert steps_to_target(valid, 2.4) == 25  # at or below
    assert steps_to_target(valid, 1.9) is None
    train = [train_record(10, 0.1), train_record(20, 0.2), train_record(30, 0.3)]
    # steps 1–10 at 0.1 s, 11–20 at 0.2 s, 21–25 at the step-30 record's 0.3 s
    assert training_seconds_until(train, 25) == pytest.approx(4.5)
    assert training_seconds_until(train, 30) == pytest.approx(6.0)


def test_a_resumed_run_keeps_the_last_record_of_each_step():
    records = [train_record(10, 0.1), train_record(20, 9.0), train_record(20, 0.2), train_record(15, 0.5)]
    assert [(r.step, r.step_time_s) for r in latest_per_step(records)] == [(10, 0.1), (15, 0.5), (20, 0.2)]


def test_aucc_of_a_linear_curve_is_its_midpoint():
    valid = [valid_record(step, 5.0 - 0.001 * step) for step in range(100, 1001, 100)]
    assert mean_loss_over_curve(valid) == pytest.approx(5.0 - 0.001 * 550)
    assert mean_loss_over_curve(valid[:1]) is None


def test_last_k_variance():
    losses = [9.0, 8.0, 2.0, 2.5, 3.0, 2.0, 2.5]
    valid = [valid_record(10 * i, loss) for i, loss in enumerate(losses, 1)]
    assert last_k_variance(valid, 5) == pytest.approx(statistics.variance([2.0, 2.5, 3.0, 2.0, 2.5]))
    assert last_k_variance(valid, 5) == pytest.approx(0.175)
    assert last_k_variance(valid[:4], 5) is None


def test_preempted_and_diverged_runs_stay_out_of_the_statistics(tmp_path):
    run_dir = write_run(tmp_path, "ora", 42, final_loss=3.0)
    run = SweepRun("ora", 42, run_dir, run_dir.read_experiment())
    assert exclusion_reason(run) is None
    summary = run_dir.read_summary()
    run_dir.write_summary(dataclasses.replace(summary, preempted=True, steps=15))
    assert exclusion_reason(run).startswith("preempted at step 15")
    run_dir.write_summary(dataclasses.replace(summary, final_valid_loss=float("nan")))
    assert "diverged" in exclusion_reason(run)


# ---------------------------------------------------------------------------- the whole report

VANILLA = {42: 3.0, 2024: 3.1, 12345: 3.2, 98765: 3.05}
ORA = {42: 3.1, 2024: 3.3, 12345: 3.2}  # seed 98765 failed; differences 0.1, 0.2, 0.0

# Post-training evaluations: attention of every vanilla seed, ora's seeds 42 and 2024 (12345 has no
# file) and frozen_gaussian 42 (no number: null); probe of two seeds of vanilla and ora.
ENTROPY = {"vanilla": {42: 0.9, 2024: 0.8, 12345: 0.85, 98765: 0.95}, "ora": {42: 0.5, 2024: 0.6}}
ENTROPY_BY_LAYER = {"vanilla": {42: [0.9, 0.8], 2024: [0.7, 0.6], 12345: [0.8, 0.9], 98765: [1.0, 0.9]},
                    "ora": {42: [0.5, 0.4], 2024: [0.7, None]}, "frozen_gaussian": {42: [None, None]}}
ACCURACY = {"vanilla": {42: 0.25, 2024: 0.5}, "ora": {42: 0.75, 2024: 1.0}}


def write_evaluations(root: Path) -> None:
    for arm, by_seed in ENTROPY_BY_LAYER.items():
        for seed, layers in by_seed.items():
            entropy = ENTROPY.get(arm, {}).get(seed)
            write_evaluation(RunDir(root / arm / f"seed{seed}"), "attention",
                             {"entropy_ratio": entropy, "attention_rank": 4.0},
                             {"entropy_ratio": False, "attention_rank": True},
                             {"entropy_ratio": layers, "attention_rank": [4.0, 4.0]})
    for arm, by_seed in ACCURACY.items():
        for seed, accuracy in by_seed.items():
            write_evaluation(RunDir(root / arm / f"seed{seed}"), "probe", {"answer_accuracy": accuracy},
                             {"answer_accuracy": True})


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    for seed, loss in VANILLA.items():
        write_run(root, "vanilla", seed, final_loss=loss,
                  train=[train_record(10, 0.1, grad_norm=0.5), train_record(20, 0.2, grad_norm=1.5)])
    for seed, loss in ORA.items():
        write_run(root, "ora", seed, final_loss=loss, frozen=200,
                  train=[train_record(10, 0.1, peak_mem_bytes=2**29, tokens_per_s=1500.0),
                         train_record(20, 0.1, peak_mem_bytes=2**29, tokens_per_s=1700.0)])
    write_run(root, "ora", 98765, status="failed", exit_code=3, git_revision="fff",
              log_tail="RuntimeError: 5 consecutive steps had non-finite loss\nTraceback (most recent call last):")
    write_run(root, "frozen_gaussian", 42, final_loss=3.4, git_revision="def")
    write_run(root, "synthesizer_random", 42, status="running", exit_code=None)
    write_evaluations(root)
    return root


@pytest.fixture(scope="module")
def report(sweep, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    build_report([sweep], out, reference="vanilla", last_k=2)
    return out


def markdown_table(report_md: str, heading: str) -> list[dict]:
    """The Markdown table under the heading (any level) as header → cell dicts."""
    section = report_md.split(f"# {heading}", 1)[1].split("\n#", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]
    return [dict(zip(split[0], row)) for row in split[2:]]


def report_json(report: Path) -> dict:
    return json.loads((report / "report.json").read_text())


def test_per_arm_final_loss_mean_and_sample_std(report):
    arms = {row["arm"]: row for row in markdown_table((report / "report.md").read_text(), "Final validation loss")}
    vanilla = list(VANILLA.values())
    assert arms["vanilla"]["seeds"] == "4"
    assert arms["vanilla"]["final valid loss"] == f"{statistics.fmean(vanilla):.4f} ± {statistics.stdev(vanilla):.4f}"
    ppl = [math.exp(v) for v in vanilla]
    assert arms["vanilla"]["final valid ppl"] == f"{statistics.fmean(ppl):.2f} ± {statistics.stdev(ppl):.2f}"
    assert arms["frozen_gaussian"]["final valid loss"] == "3.4000 ± n/a"
    assert arms["synthesizer_random"]["seeds"] == "0"
    assert arms["synthesizer_random"]["final valid loss"] == "n/a"
    assert list(arms) == ["vanilla", "frozen_gaussian", "ora", "synthesizer_random"]


def test_comparison_pairs_seeds_and_marks_na(report):
    rows = {row["arm"]: row for row in report_json(report)["tables"]["comparison"]}
    ora = rows["ora"]
    assert ora["pairs"] == 3 and ora["mean_difference"] == pytest.approx(0.1)
    expected_t = stats.ttest_rel(list(ORA.values()), [VANILLA[s] for s in ORA]).pvalue
    assert ora["t_test_p"] == pytest.approx(expected_t)
    assert ora["t_test_p_holm"] == pytest.approx(expected_t)  # the only t-test p in the family
    # one zero difference discarded, two positive ones left (tied with nothing): 2 · 1/4
    assert ora["wilcoxon_p"] == pytest.approx(0.5)
    assert ora["cohens_dz"] == pytest.approx(0.1 / 0.1)
    gaussian, synthesizer = rows["frozen_gaussian"], rows["synthesizer_random"]
    assert gaussian["pairs"] == 1 and gaussian["t_test_p"] is None and gaussian["cohens_dz"] is None
    assert synthesizer["pairs"] == 0 and synthesizer["mean_difference"] is None
    md = {row["arm"]: row for row in markdown_table((report / "report.md").read_text(), "Paired comparison")}
    assert md["frozen_gaussian"]["t-test p"] == md["frozen_gaussian"]["Cohen's d_z"] == "n/a"
    assert md["frozen_gaussian"]["note"] == "fewer than two paired seeds"


def test_default_target_is_the_reference_worst_final_loss(report):
    settings = report_json(report)["settings"]
    assert settings["target_loss"] == 3.2
    assert "worst final validation loss of vanilla" in settings["target_source"]
    assert "Target validation loss: 3.2000 (default" in (report / "report.md").read_text()
    runs = {(row["arm"], row["seed"]): row for row in report_json(report)["tables"]["runs"]}
    # The curve is 4.0 at step 10, the final loss at step 20: at or below 3.2 at step 20 or never.
    assert runs[("vanilla", 12345)]["steps_to_target"] == 20
    assert runs[("vanilla", 12345)]["seconds_to_target"] == pytest.approx(10 * 0.1 + 10 * 0.2)
    assert runs[("ora", 2024)]["target_reached"] is False and runs[("ora", 2024)]["steps_to_target"] is None
    md = {(r["arm"], r["seed"]): r for r in markdown_table((report / "report.md").read_text(), "Per run")}
    assert md[("ora", "2024")]["steps to target"] == "not reached"


def test_the_report_names_the_revisions_its_runs_trained_at(report):
    # Counted over the runs in the statistics: the failed run's revision is not among them.
    assert report_json(report)["settings"]["revisions"] == {"abc": 7, "def": 1}
    assert "the runs span 2 git revisions (`abc` × 7, `def` × 1)" in (report / "report.md").read_text()
    assert revisions_text({"abc": 3}) == "Code: every run at git revision `abc` × 3."


def test_convergence_and_cost_per_arm(report):
    arms = {row["arm"]: row for row in report_json(report)["tables"]["convergence"]}
    assert arms["ora"]["reached_target"] == 2 and arms["ora"]["steps_to_target_mean"] == 20
    assert arms["vanilla"]["grad_norm_median_mean"] == pytest.approx(1.0)
    assert arms["vanilla"]["clipped_fraction_mean"] == pytest.approx(0.5)  # 1.5 > clip_grad 1.0
    assert arms["vanilla"]["last_k_variance_mean"] is not None
    cost = {row["arm"]: row for row in report_json(report)["tables"]["cost"]}
    assert cost["ora"]["tokens_per_s_median_mean"] == pytest.approx(1600.0)
    assert cost["ora"]["peak_memory_gib_mean"] == pytest.approx(0.5)
    assert cost["ora"]["frozen_params_mean"] == 200 and cost["ora"]["trainable_params_mean"] == 800
    assert cost["synthesizer_random"]["tokens_per_s_median_mean"] is None


def test_failed_running_and_missing_runs_are_listed(report):
    rows = {(r["arm"], r["seed"]): r for r in markdown_table((report / "report.md").read_text(),
                                                             "Runs not in the statistics")}
    failed = rows[("ora", "98765")]
    assert (failed["status"], failed["exit code"]) == ("failed", "3")
    assert failed["log tail, first line"] == "`RuntimeError: 5 consecutive steps had non-finite loss`"
    assert rows[("synthesizer_random", "42")]["status"] == "running"
    for arm in ("frozen_gaussian", "synthesizer_random"):
        for seed in ("2024", "12345", "98765"):
            assert rows[(arm, seed)]["status"] == "missing"
    assert ("vanilla", "42") not in rows and len(rows) == 2 + 2 * 3


def test_plots_are_png_files(report):
    for name in (plots.VALID_CURVES, plots.FINAL_LOSS, plots.SPEED_MEMORY):
        data = (report / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
        assert f"]({name})" in (report / "report.md").read_text()


def test_csv_json_and_markdown_agree(report):
    """Every CSV cell is the JSON value (n/a ↔ null), and every Markdown table has the JSON's rows in order."""
    document = report_json(report)
    headings = {"arms": "Final validation loss", "comparison": "Paired comparison", "convergence": "Convergence",
                "cost": "Speed, memory", "evaluations": "Post-training evaluations", "runs": "Per run",
                "not_used": "Runs not in the statistics"}
    assert set(document["tables"]) == set(headings) | {"evaluation_layers"}  # the plots' numbers: CSV and JSON
    for name, records in document["tables"].items():
        with open(report / f"{name}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == len(records)
        for row, record in zip(rows, records):
            assert row.keys() == record.keys()
            for key, value in record.items():
                assert row[key] == ("n/a" if value is None else str(value)), (name, key)
        if name in headings:
            md = markdown_table((report / "report.md").read_text(), headings[name])
            assert [r["arm"] for r in md] == [r["arm"] for r in records]
    arms = {r["arm"]: r for r in document["tables"]["arms"]}
    md_arms = {r["arm"]: r for r in markdown_table((report / "report.md").read_text(), "Final validation loss")}
    for arm, record in arms.items():
        mean, std = record["final_valid_loss_mean"], record["final_valid_loss_std"]
        expected = "n/a" if mean is None else f"{mean:.4f} ± {'n/a' if std is None else f'{std:.4f}'}"
        assert md_arms[arm]["final valid loss"] == expected
    comparison = {r["arm"]: r for r in document["tables"]["comparison"]}
    md_comparison = {r["arm"]: r for r in markdown_table((report / "report.md").read_text(), "Paired comparison")}
    assert md_comparison["ora"]["t-test p"] == f"{comparison['ora']['t_test_p']:.4g}"


def test_evaluations_per_arm_with_paired_tests_and_missing_runs_counted(report):
    rows = {(r["evaluation"], r["metric"], r["arm"]): r for r in report_json(report)["tables"]["evaluations"]}
    vanilla = rows[("attention", "entropy_ratio", "vanilla")]
    assert (vanilla["seeds"], vanilla["missing"], vanilla["higher_is_better"]) == (4, 0, False)
    assert vanilla["mean"] == pytest.approx(statistics.fmean(ENTROPY["vanilla"].values()))
    assert vanilla["std"] == pytest.approx(statistics.stdev(ENTROPY["vanilla"].values()))
    assert (vanilla["t_test_p"], vanilla["note"]) == (None, "reference")
    ora = rows[("attention", "entropy_ratio", "ora")]
    assert (ora["seeds"], ora["missing"], ora["missing_seeds"], ora["pairs"]) == (2, 1, "12345", 2)
    assert ora["mean_difference"] == pytest.approx(-0.3)  # 0.5 − 0.9, 0.6 − 0.8
    expected_t = stats.ttest_rel([0.5, 0.6], [0.9, 0.8]).pvalue
    assert ora["t_test_p"] == pytest.approx(expected_t)
    assert ora["t_test_p_holm"] == pytest.approx(expected_t)  # the only arm with a p-value for this metric
    gaussian = rows[("attention", "entropy_ratio", "frozen_gaussian")]  # its file says null: missing, not 0
    assert (gaussian["seeds"], gaussian["missing"], gaussian["mean"], gaussian["pairs"]) == (0, 1, None, 0)
    assert rows[("attention", "entropy_ratio", "synthesizer_random")]["missing"] == 0  # not in the statistics
    probe = rows[("probe", "answer_accuracy", "ora")]
    assert probe["mean_difference"] == pytest.approx(0.5) and probe["t_test_p"] is None
    assert "zero variance" in probe["note"]
    assert rows[("probe", "answer_accuracy", "vanilla")]["missing_seeds"] == "12345, 98765"
    text = (report / "report.md").read_text()
    assert "`attention` 7 of 8, `probe` 4 of 8" in text
    md = {(r["evaluation"], r["metric"], r["arm"]): r for r in markdown_table(text, "Post-training evaluations")}
    assert md[("attention", "entropy_ratio", "frozen_gaussian")]["mean ± std"] == "n/a"
    assert md[("attention", "entropy_ratio", "frozen_gaussian")]["missing"] == "1 (42)"
    assert md[("attention", "entropy_ratio", "ora")]["better"] == "lower"


def test_per_layer_plots_and_their_numbers(report):
    text = (report / "report.md").read_text()
    for metric in ("entropy_ratio", "attention_rank"):
        name = layer_plot_name("attention", metric)
        assert (report / name).read_bytes().startswith(PNG_SIGNATURE) and f"]({name})" in text
    assert not (report / layer_plot_name("probe", "answer_accuracy")).exists()  # no per_layer in its files
    rows = {(r["metric"], r["arm"], r["layer"]): r for r in report_json(report)["tables"]["evaluation_layers"]}
    layer1 = rows[("entropy_ratio", "vanilla", 1)]
    assert (layer1["seeds"], layer1["mean"]) == (4, pytest.approx(statistics.fmean([0.9, 0.7, 0.8, 1.0])))
    assert (rows[("entropy_ratio", "ora", 2)]["seeds"], rows[("entropy_ratio", "ora", 2)]["mean"]) == (1, 0.4)
    assert rows[("entropy_ratio", "frozen_gaussian", 1)]["mean"] is None


def test_report_writes_its_main_tables_as_latex(report):
    for name in ("arms", "comparison", "convergence", "cost", "evaluations"):
        text = (report / f"{name}.tex").read_text()
        assert r"\toprule" in text and r"\bottomrule" in text and f"\\label{{tab:{name}}}" in text
    arms = (report / "arms.tex").read_text()
    vanilla = list(VANILLA.values())
    assert f"vanilla & $4$ & ${statistics.fmean(vanilla):.4f} \\pm {statistics.stdev(vanilla):.4f}$" in arms
    assert "frozen\\_gaussian & $1$ & $3.4000 \\pm \\mathrm{n/a}$" in arms
    assert "seed list" not in arms  # a Markdown-only column
    assert "frozen\\_gaussian" in (report / "evaluations.tex").read_text()


def test_latex_table_by_hand(tmp_path):
    rows = [{"arm": "ref_arm", "mean": 1.2345, "std": 0.0123, "p": None},
            {"arm": "a_b%c", "mean": 2.5, "std": 0.25, "p": 0.004},
            {"arm": "d&e#f", "mean": 1000.0, "std": None, "p": 0.03},
            {"arm": "g", "mean": None, "std": None, "p": 0.001},
            {"arm": "h", "mean": 3.0, "std": 0.5, "p": 0.05}]
    table = Table("hand", [Column("arm", ("arm",), plain),
                           Column("loss", ("mean", "std"), mean_std(fixed(3)), mark="p"),
                           Column("p (Holm)", ("p",), fixed(3), latex=False)], rows)
    text = write_latex(table, tmp_path, "Hand table.").read_text()
    body = text[text.index(r"\midrule"):text.index(r"\bottomrule")].splitlines()[1:]
    assert body == [r"ref\_arm & $1.234 \pm 0.012$ \\",
                    r"a\_b\%c & $2.500 \pm 0.250^{**}$ \\",  # p < 0.01
                    r"d\&e\#f & $1{,}000.000 \pm \mathrm{n/a}^{*}$ \\",  # p < 0.05
                    r"g & n/a \\",  # no value, no mark
                    r"h & $3.000 \pm 0.500$ \\"]  # p = 0.05 is not below 0.05
    assert r"\begin{tabular}{lr}" in text and "|" not in text  # no vertical rules, the p column left out
    assert text.index(r"\toprule") < text.index(r"arm & loss \\") < text.index(r"\midrule")
    assert r"\caption{Hand table. $^{*}$: Holm-adjusted $p < 0.05$; $^{**}$: Holm-adjusted $p < 0.01$.}" in text


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a readable JSON evaluation"),
    ('{"summary": {"a": 1.0}, "higher_is_better": {}}', "'higher_is_better' must give"),
    ('{"summary": {"a": "high"}, "higher_is_better": {"a": true}}', "summary.a is 'high'"),
])
def test_an_invalid_evaluation_file_is_an_error_naming_it(tmp_path, content, message):
    path = tmp_path / "attention.json"
    path.write_text(content)
    with pytest.raises(ReportError, match=message) as error:
        read_evaluation(path)
    assert str(path) in str(error.value)


@pytest.mark.slow
def test_command_line_and_its_errors(sweep, tmp_path, capsys):
    main([str(sweep), "--out", str(tmp_path / "out"), "--target-loss", "3.15", "--last-k", "2"])
    assert "report:" in capsys.readouterr().out
    settings = report_json(tmp_path / "out")["settings"]
    assert (settings["target_loss"], settings["target_source"]) == (3.15, "given with --target-loss")
    with pytest.raises(SystemExit) as exit_info:
        main([str(sweep), "--out", str(tmp_path / "other"), "--reference", "vanila"])
    assert exit_info.value.code == 2
    assert "reference arm 'vanila' has no run" in capsys.readouterr().err


# ---------------------------------------------------------------------------- gaps: arm − twin by shape

# Shapes of a heads sweep at d 128 (head_dim 64, 32, 16), both arms on seeds 1-5. Each seed's gap
# (ora − vanilla) is exactly linear in log2 head_dim: c_s + b_s · (log2 x − 5), so every seed's
# fitted slope is b_s. heads2_ora seed 5 failed; heads16_ora is a spec arm without a twin or a run.
GAP_SEEDS = (1, 2, 3, 4, 5)
GAPS = {"arm": "ora", "reference": "vanilla", "x": "head_dim", "metrics": ["probe.answer_accuracy"]}
HEADS = {"heads8": 8, "heads4": 4, "heads2": 2}  # by head_dim 16, 32, 64
GAP_C = {1: 0.055, 2: 0.07, 3: 0.035, 4: 0.065, 5: 0.04}  # no two gaps of a shape tie
GAP_B = {1: -0.05, 2: -0.04, 3: -0.06, 4: -0.05, 5: -0.045}


def head_dim(shape: str) -> int:
    return 128 // HEADS[shape]


def known_gap(seed: int, shape: str) -> float:
    return GAP_C[seed] + GAP_B[seed] * (math.log2(head_dim(shape)) - 5)


def vanilla_loss(seed: int, shape: str) -> float:
    return 3.0 + 0.1 * HEADS[shape] + 0.01 * (seed * HEADS[shape] % 7)  # shapes differ beyond an offset


def ora_loss(seed: int, shape: str) -> float:
    return vanilla_loss(seed, shape) + known_gap(seed, shape)


def vanilla_accuracy(seed: int) -> float:
    return 0.2 + 0.1 * (seed % 3)


def ora_accuracy(seed: int) -> float:
    return vanilla_accuracy(seed) + 0.05 * (seed - 2)  # seed 1 worse, seed 2 level, the rest better


def write_gaps_spec(directory: Path, gaps: dict) -> Path:
    arms = {f"{shape}_{kind}": {"set": {"model.attention.type": kind}}
            for shape in HEADS for kind in ("ora", "vanilla")}
    spec = {"config": "small", "reference": "heads8_vanilla", "seeds": list(GAP_SEEDS), "scales": {"cpu": {}},
            "arms": {**arms, "heads16_ora": {"set": {"model.attention.type": "ora"}}}, "evaluations": ["probe"],
            "gaps": gaps}
    path = directory / "heads.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def gap_sweep(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gap_sweep")
    for shape, heads in HEADS.items():
        model = {"hidden_size": 128, "num_attention_heads": heads, "ffn_hidden_size": 512}
        for seed in GAP_SEEDS:
            write_run(root, f"{shape}_vanilla", seed, final_loss=vanilla_loss(seed, shape), model=model)
            if (shape, seed) == ("heads2", 5):
                write_run(root, "heads2_ora", seed, status="failed", exit_code=3, model=model,
                          log_tail="RuntimeError: 5 consecutive steps had non-finite loss")
            else:
                write_run(root, f"{shape}_ora", seed, final_loss=ora_loss(seed, shape), model=model, frozen=100)
                write_evaluation(RunDir(root / f"{shape}_ora" / f"seed{seed}"), "probe",
                                 {"answer_accuracy": ora_accuracy(seed)}, {"answer_accuracy": True})
            if (shape, seed) != ("heads8", 1):  # its probe did not run
                write_evaluation(RunDir(root / f"{shape}_vanilla" / f"seed{seed}"), "probe",
                                 {"answer_accuracy": vanilla_accuracy(seed)}, {"answer_accuracy": True})
    return root, write_gaps_spec(root.parent, GAPS)


@pytest.fixture(scope="module")
def gap_report(gap_sweep, tmp_path_factory) -> Path:
    root, spec = gap_sweep
    out = tmp_path_factory.mktemp("gap_report")
    build_report([root], out, spec=spec, last_k=2)
    return out


def test_gap_per_shape_mean_interval_and_tests(gap_report):
    rows = {row["shape"]: row for row in report_json(gap_report)["tables"]["gaps"]}
    assert [row["shape"] for row in report_json(gap_report)["tables"]["gaps"]] == ["heads8", "heads4", "heads2"]
    for shape, row in rows.items():
        seeds = [s for s in GAP_SEEDS if (shape, s) != ("heads2", 5)]
        gaps = [ora_loss(s, shape) - vanilla_loss(s, shape) for s in seeds]  # known_gap, up to rounding
        assert (row["x"], row["pairs"]) == (head_dim(shape), len(seeds))
        assert row["mean_difference"] == pytest.approx(statistics.fmean(gaps))
        low, high = stats.t.interval(0.95, len(gaps) - 1, loc=statistics.fmean(gaps), scale=stats.sem(gaps))
        assert (row["ci_low"], row["ci_high"]) == (pytest.approx(low), pytest.approx(high))
        assert row["t_test_p"] == pytest.approx(stats.ttest_1samp(gaps, 0.0).pvalue)
        assert row["wilcoxon_p"] == pytest.approx(stats.wilcoxon(gaps).pvalue)
        assert row["worse"] == sum(g > 0 for g in gaps)
    # heads2: gaps 0.005, 0.03, −0.025, 0.015 (seed 3 better with ora); seed 5 failed, named
    assert rows["heads2"]["worse_seeds"] == "1, 2, 4"
    assert rows["heads2"]["unpaired"] == "5: heads2_ora failed (exit 3)"
    assert rows["heads8"]["unpaired"] == rows["heads8"]["note"] == ""


def test_gap_holm_across_shapes(gap_report):
    rows = report_json(gap_report)["tables"]["gaps"]
    for test in ("t_test_p", "wilcoxon_p"):
        raw = [row[test] for row in rows]
        order = sorted(range(3), key=lambda i: raw[i])
        expected, running = [0.0] * 3, 0.0
        for rank, i in enumerate(order):  # step-down: × 3, × 2, × 1, kept monotone, capped at 1
            running = max(running, min(1.0, (3 - rank) * raw[i]))
            expected[i] = running
        assert [row[f"{test}_holm"] for row in rows] == pytest.approx(expected)
    # the smallest raw t-test p is heads8's (all gaps near 0.1), multiplied by the family's 3
    assert rows[0]["t_test_p_holm"] == pytest.approx(3 * rows[0]["t_test_p"])


def test_gap_trend_is_the_mean_of_the_seeds_slopes_on_log2_x(gap_report):
    trend, power = report_json(gap_report)["tables"]["gap_trend"]
    assert (trend["fit"], power["fit"]) == ("a + b · log2 x", "a · x^b")
    slopes = list(GAP_B.values())  # seed 5 has two shapes left: its slope is still b_5
    assert trend["seeds"] == 5 and trend["slope"] == pytest.approx(statistics.fmean(slopes))
    half = stats.t.ppf(0.975, 4) * statistics.stdev(slopes) / math.sqrt(5)
    assert trend["ci_low"] == pytest.approx(statistics.fmean(slopes) - half)
    assert trend["ci_high"] == pytest.approx(statistics.fmean(slopes) + half)
    assert trend["p"] == pytest.approx(stats.ttest_1samp(slopes, 0.0).pvalue)
    assert trend["intercept"] == pytest.approx(statistics.fmean(GAP_C[s] - 5 * GAP_B[s] for s in GAP_SEEDS))
    assert trend["verdict"].startswith("The gap (ora − vanilla) falls with head_dim")
    # seed 3's heads2 gap is −0.025: no power law, and the row says where
    assert power["slope"] is None and power["note"].startswith("seed 3 has a difference ≤ 0 at x = 64")
    assert "As a power law, gap = a · head_dim^b: no estimate: seed 3" in (gap_report / "report.md").read_text()


def test_log_trend_recovers_a_known_law_and_says_when_seeds_cannot_tell():
    # gap = 0.3 − 0.02 · log2 x on every seed, plus a seed offset: every slope is −0.02
    xs = [2.0**20, 2.0**21, 2.0**22, 2.0**23]
    exact = log_trend({seed: [(x, 0.3 + 0.01 * seed - 0.02 * math.log2(x)) for x in xs] for seed in range(5)})
    assert exact.slope == pytest.approx(-0.02) and exact.intercept == pytest.approx(0.32)
    assert exact.ci_low is None and "zero variance" in exact.note
    # slopes −0.06, −0.04, ..., 0.02 (mean −0.02, std 0.0316): the interval holds 0, and the verdict says so
    spread_out = log_trend({seed: [(x, (-0.02 + 0.02 * (seed - 2)) * math.log2(x)) for x in xs] for seed in range(5)})
    assert spread_out.slope == pytest.approx(-0.02) and spread_out.ci_low < 0 < spread_out.ci_high
    gaps = GapsSpec(arm="ora", reference="vanilla", x="parameters")
    assert verdict(spread_out, gaps).startswith("The slope's 95% interval includes 0: 5 seeds cannot tell")
    assert log_trend({1: [(8.0, 0.1)]}).slope is None  # one x: no slope


def test_power_trend_recovers_a_known_exponent_seed_by_seed():
    # gap = c_s · x^b_s with exponents −0.3 ± 0.05 and different prefactors: b̄ = −0.3, a = e^(mean ln c_s)
    xs, exponents, prefactors = [1e5, 4e5, 1.6e6, 6.4e6], [-0.35, -0.3, -0.25, -0.3, -0.3], [5.0, 8.0, 6.0, 7.0, 9.0]
    trend = power_trend({seed: [(x, prefactors[seed] * x**exponents[seed]) for x in xs] for seed in range(5)})
    assert trend.seeds == 5 and trend.slope == pytest.approx(-0.3)
    assert trend.intercept == pytest.approx(statistics.fmean(math.log(c) for c in prefactors))
    half = stats.t.ppf(0.975, 4) * statistics.stdev(exponents) / math.sqrt(5)
    assert (trend.ci_low, trend.ci_high) == (pytest.approx(-0.3 - half), pytest.approx(-0.3 + half))
    assert trend.p == pytest.approx(stats.ttest_1samp(exponents, 0.0).pvalue)
    assert verdict(trend, GapsSpec(arm="ora", reference="vanilla", x="parameters"), "power").startswith(
        "As a power law, gap = a · parameters^b: the gap (ora − vanilla) falls with parameters (exponent -0.3")
    assert power_trend({1: [(8.0, 0.1), (16.0, 0.0)]}).note == "seed 1 has a difference ≤ 0 at x = 16: " \
        "no power law (one sign) fits"


@pytest.mark.parametrize("quantity, expected", [("head_dim", 32), ("seq_length", 256), ("num_layers", 6),
                                                 ("parameters", 12345)])
def test_x_is_read_from_the_run(tmp_path, quantity, expected):
    model = {"hidden_size": 128, "num_attention_heads": 4, "seq_length": 256, "num_layers": 6}
    run_dir = write_run(tmp_path, "a", 1, final_loss=3.0, model=model, params=12345, frozen=45)
    assert run_x(SweepRun("a", 1, run_dir, run_dir.read_experiment()), quantity) == expected


@pytest.mark.parametrize("value, label", [(64, "64"), (2048, "2048"), (158_528, "159k"), (810_240, "810k"),
                                          (2_250_048, "2.25M"), (6_352_384, "6.35M")])
def test_gap_figure_ticks_read_as_numbers(value, label):
    assert plots._x_label(value) == label


def test_gap_figure_latex_and_markdown(gap_report):
    assert (gap_report / plots.GAPS).read_bytes().startswith(PNG_SIGNATURE)
    text = (gap_report / "report.md").read_text()
    assert f"]({plots.GAPS})" in text and "## Gap by shape: `<shape>_ora` − `<shape>_vanilla` against head_dim" in text
    md = {row["shape"]: row for row in markdown_table(text, "Gap by shape")}
    assert md["heads2"]["ora worse"] == "3 of 4" and md["heads2"]["not paired"] == "5: heads2_ora failed (exit 3)"
    latex = (gap_report / "gaps.tex").read_text()
    assert r"\toprule" in latex and r"\label{tab:gaps}" in latex and "not paired" not in latex
    row = report_json(gap_report)["tables"]["gaps"][0]
    assert f"heads8 & $16$ & $5$ & ${row['mean_difference']:.4f}" in latex
    assert f"$[{row['ci_low']:.4f}, {row['ci_high']:.4f}]$" in latex
    assert r"\label{tab:gap_trend}" in (gap_report / "gap_trend.tex").read_text()
    seeds = report_json(gap_report)["tables"]["gap_seeds"]
    assert len(seeds) == 14 and [r["gap"] for r in seeds if r["shape"] == "heads2"] == pytest.approx(
        [known_gap(s, "heads2") for s in (1, 2, 3, 4)])


def test_gap_of_an_evaluation_metric_per_shape(gap_report):
    """probe.answer_accuracy (higher is better): ora − vanilla per shape, worse where ora's is lower; a
    run without the evaluation leaves its seed unpaired, named."""
    rows = {row["shape"]: row for row in report_json(gap_report)["tables"]["gaps_probe_answer_accuracy"]}
    assert list(rows) == ["heads8", "heads4", "heads2"]
    for shape, row in rows.items():
        seeds = [s for s in GAP_SEEDS if (shape, s) not in {("heads2", 5), ("heads8", 1)}]
        gaps = [ora_accuracy(s) - vanilla_accuracy(s) for s in seeds]
        assert row["pairs"] == len(seeds) and row["mean_difference"] == pytest.approx(statistics.fmean(gaps))
        assert row["t_test_p"] == pytest.approx(stats.ttest_1samp(gaps, 0.0).pvalue)
        assert row["worse_seeds"] == ("" if shape == "heads8" else "1")  # lower accuracy; seed 2 is level
    assert rows["heads8"]["unpaired"] == "1: no value"
    assert rows["heads2"]["unpaired"] == "5: heads2_ora failed (exit 3)"
    text = (gap_report / "report.md").read_text()
    assert "### probe.answer_accuracy: `<shape>_ora` − `<shape>_vanilla`" in text and "higher is better" in text
    md = {row["shape"]: row for row in markdown_table(text, "probe.answer_accuracy")}
    assert md["heads4"]["ora worse"] == "1 of 5"
    assert r"\label{tab:gaps_probe_answer_accuracy}" in (gap_report / "gaps_probe_answer_accuracy.tex").read_text()


def test_a_spec_lists_its_arms_without_runs_and_gives_the_reference(gap_report):
    document = report_json(gap_report)
    assert document["settings"]["reference"] == "heads8_vanilla"
    assert document["settings"]["gaps"] == GAPS
    not_used = {(r["arm"], r["seed"]): r["status"] for r in document["tables"]["not_used"]}
    assert not_used == {("heads2_ora", 5): "failed", **{("heads16_ora", s): "missing" for s in GAP_SEEDS}}


def test_without_gaps_the_report_has_no_gap_part(report):
    assert "gaps" not in report_json(report)["tables"] and not (report / plots.GAPS).exists()
    assert "## Gap by shape" not in (report / "report.md").read_text()


@pytest.mark.parametrize("gaps, key", [({"arm": "ora", "reference": "vanilla", "x": "width"}, "gaps.x"),
                                       ({"arm": "ora", "reference": "vanila", "x": "head_dim"}, "gaps"),
                                       ({"arm": "ora", "reference": "vanilla", "y": 1}, "gaps.y"),
                                       ({**GAPS, "metrics": ["answer_accuracy"]}, "gaps.metrics"),
                                       ({**GAPS, "metrics": ["attention.entropy_ratio"]}, "gaps.metrics")])
def test_an_invalid_gaps_key_is_refused_naming_it(gap_sweep, tmp_path, capsys, gaps, key):
    spec = write_gaps_spec(tmp_path, gaps)
    with pytest.raises(SystemExit) as exit_info:
        main([str(gap_sweep[0]), "--out", str(tmp_path / "out"), "--spec", str(spec)])
    assert exit_info.value.code == 2
    assert f"config error at '{key}'" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_per_source_columns(tmp_path):
    """Runs whose summaries hold each source's final loss get a table with a column pair per source:
    mean ± std over seeds, and arm − reference over the paired seeds."""
    losses = {("vanilla", 1): {"code": 2.0, "prose": 3.0}, ("vanilla", 2): {"code": 2.2, "prose": 3.2},
              ("ora", 1): {"code": 2.5, "prose": 3.1}, ("ora", 2): {"code": 2.9, "prose": 3.1}}
    for (arm, seed), by_source in losses.items():
        run_dir = write_run(tmp_path / "sweep", arm, seed, final_loss=2.5)
        run_dir.write_summary(dataclasses.replace(run_dir.read_summary(), final_valid_loss_by_source=by_source))
    out = tmp_path / "report"
    build_report([tmp_path / "sweep"], out, reference="vanilla", last_k=2)
    rows = {row["arm"]: row for row in markdown_table((out / "report.md").read_text(),
                                                      "Final validation loss per data source")}
    assert rows["vanilla"]["code"] == "2.1000 ± 0.1414" and rows["vanilla"]["code − ref"] == "n/a"
    assert rows["ora"]["code"] == "2.7000 ± 0.2828" and rows["ora"]["code − ref"] == "0.6000"
    assert rows["ora"]["prose − ref"] == "0.0000"
    ora = next(r for r in report_json(out)["tables"]["sources"] if r["arm"] == "ora")
    assert ora["prose_diff"] == pytest.approx(0.0, abs=1e-12) and (out / "sources.csv").is_file()


def test_no_per_source_table_without_sources(report):
    assert "per data source" not in (report / "report.md").read_text() and not (report / "sources.csv").exists()
