"""The user-facing tools on input that parses but cannot be honoured: pretrain.export.generate (never
the network, positions, empty prompt, flags), pretrain.research.report and pretrain.research.memory_plan
(flags, folders), and the quickstart's stages (outputs gone since a stage finished, progress, what to do next)."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path

import pytest
from data_fixtures import word_tokenizer
from network_guard import no_network

from pretrain import quickstart
from pretrain.export.generate import main as generate_main
from pretrain.research import memory_plan as plan
from pretrain.research.report.__main__ import main as report_main
from pretrain.run_files.run_dir import RunDir
from pretrain.run_files.run_records import EvalRecord, TrainRecord

# ---------------------------------------------------------------------------- pretrain.export.generate
POSITIONS = 16
WORDS = "the quick brown fox jumps over lazy dog def main self return import class".split()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A directory as convert_to_hf writes it, without a training run: the exported tokenizer of a
    small sentencepiece model and an untrained GPT-2 of POSITIONS positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from pretrain.export.hf_tokenizer import export_tokenizer

    root = tmp_path_factory.mktemp("generate")
    out = root / "hf"
    tokenizer = export_tokenizer(word_tokenizer(root, WORDS, vocab_size=400, words_per_line=30), out)
    config = GPT2Config(vocab_size=400, n_positions=POSITIONS, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(out)
    return out


def test_generate_never_reaches_the_network(hf_dir, tmp_path, monkeypatch, capsys):
    """A mistyped path looks like a hub repository id ('demo/hff'): it is an error naming the path."""
    monkeypatch.chdir(tmp_path)
    with no_network() as attempts:
        code = generate_main(["--hf", "demo/hff", "--prompt", "the quick"])
    assert (code, attempts) == (2, [])
    assert "--hf demo/hff: not a directory written by pretrain.export.convert_to_hf" in capsys.readouterr().err
    with no_network() as attempts:
        code = generate_main(["--hf", str(hf_dir), "--prompt", "the quick", "--max-new-tokens", "3",
                              "--temperature", "0"])
    assert (code, attempts) == (0, [])
    assert capsys.readouterr().out.startswith("the quick")


def test_generate_refuses_more_tokens_than_positions(hf_dir, capsys):
    from transformers import AutoTokenizer

    prompt = "the quick"
    prompt_tokens = len(AutoTokenizer.from_pretrained(hf_dir)(prompt)["input_ids"])
    fits = POSITIONS - prompt_tokens
    assert fits > 1
    assert generate_main(["--hf", str(hf_dir), "--prompt", prompt, "--max-new-tokens", str(fits + 1)]) == 2
    err = capsys.readouterr().err
    assert f"--prompt ({prompt_tokens} tokens) + --max-new-tokens {fits + 1} = {POSITIONS + 1} tokens" in err
    assert f"the model's {POSITIONS} positions" in err
    assert generate_main(["--hf", str(hf_dir), "--prompt", prompt, "--max-new-tokens", str(fits)]) == 0


@pytest.mark.parametrize("flags, message", [
    (["--prompt", ""], "--prompt '' gives no tokens"),
    (["--prompt", "the", "--max-new-tokens", "-5"], "--max-new-tokens must be at least 1, got -5"),
    (["--prompt", "the", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--prompt", "the", "--temperature", "-1"], "--temperature must be 0 (greedy) or more"),
])
def test_generate_refuses_what_it_cannot_sample(hf_dir, capsys, flags, message):
    assert generate_main(["--hf", str(hf_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---------------------------------------------------------------------------- pretrain.research.report
def report_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        report_main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_report_names_a_missing_directory(tmp_path, capsys):
    err = report_error([str(tmp_path / "sweeps" / "cor"), "--out", str(tmp_path / "report")], capsys)
    assert f"{tmp_path / 'sweeps' / 'cor'}: no such directory" in err


def test_report_on_a_training_run_says_it_reads_sweep_outputs(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    run.write_config({})
    err = report_error([str(run.path), "--out", str(tmp_path / "report")], capsys)
    assert f"{run.path}, a training run dir, not a sweep's output" in err
    assert "The report reads sweep output directories: the --out of `python -m pretrain.research.sweep`" in err
    err = report_error([str(tmp_path), "--out", str(tmp_path / "report")], capsys)
    assert f"{tmp_path}, which holds 1 training run dir (config.yaml)" in err
    assert not (tmp_path / "report").exists()


def test_report_out_that_is_a_file_is_refused(tmp_path, capsys):
    from sweep_runs import write_run

    write_run(tmp_path / "sweep", "vanilla", 42, final_loss=3.0)
    (tmp_path / "notes.txt").write_text("mine")
    err = report_error([str(tmp_path / "sweep"), "--out", str(tmp_path / "notes.txt")], capsys)
    assert f"--out {tmp_path / 'notes.txt'} is a file" in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------------- pretrain.research.memory_plan
@pytest.mark.parametrize("flags, message", [
    (["--world-size", "0"], "'--world-size': must be at least 1, got 0"),
    (["--world-size", "8", "--gpu-memory-gb", "-5"], "'--gpu-memory-gb': must be a positive number of GiB, got -5.0"),
    (["--world-size", "8", "--gpu-memory-gb", "nan"], "'--gpu-memory-gb': must be a positive number of GiB"),
])
def test_plan_refuses_flags_naming_them(capsys, flags, message):
    assert plan.main(["--config", "small", *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


# ---------------------------------------------------------------------------- the quickstart
def writing_stage(name: str, output: str) -> quickstart.Stage:
    """A stand-in stage whose command writes OUT/<output> and prints '<name>: wrote it'."""
    def argv(flow):
        return ["sh", "-c", f"echo {name} > {shlex.quote(str(flow.out / output))} && echo '{name}: wrote it'"]

    return quickstart.Stage(name, argv, quickstart._line_starting(f"{name}:"), lambda flow: [flow.out / output])


def stand_ins() -> list[quickstart.Stage]:
    return [writing_stage("first", "a.txt"), writing_stage("second", "b.txt"), writing_stage("third", "c.txt")]


def stage_lines(out: str) -> dict[str, str]:
    return {line.split()[1]: line for line in out.splitlines() if line.startswith("[")}


def test_a_done_stage_whose_outputs_are_gone_runs_again_with_the_stages_after_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(quickstart, "STAGES", stand_ins())
    argv = ["--out", str(tmp_path / "demo")]
    assert quickstart.main(argv) == 0
    first = capsys.readouterr().out
    assert all("wrote it" in line and "done earlier" not in line for line in stage_lines(first).values())
    assert "next, after `. .venv/bin/activate`:" in first
    assert quickstart.main(argv) == 0
    assert all("(done earlier)" in line for line in stage_lines(capsys.readouterr().out).values())
    (tmp_path / "demo" / "b.txt").unlink()  # as `rm -r runs/demo/hf` after a finished demo
    assert quickstart.main(argv) == 0
    again = stage_lines(capsys.readouterr().out)
    assert "(done earlier)" in again["first"]
    assert "(done earlier)" not in again["second"] and "(done earlier)" not in again["third"]
    assert (tmp_path / "demo" / "b.txt").exists()


def test_a_stage_that_fails_when_redone_keeps_no_earlier_done(tmp_path, monkeypatch, capsys):
    stages = stand_ins()
    monkeypatch.setattr(quickstart, "STAGES", stages)
    assert quickstart.main(["--out", str(tmp_path / "demo")]) == 0
    (tmp_path / "demo" / "b.txt").unlink()
    failing = quickstart.Stage("second", lambda flow: ["sh", "-c", "echo broken; exit 3"],
                               quickstart._line_starting("second:"), lambda flow: [flow.out / "b.txt"])
    monkeypatch.setattr(quickstart, "STAGES", [stages[0], failing, stages[2]])
    assert quickstart.main(["--out", str(tmp_path / "demo")]) == 1
    assert "[2/3] second    error: exit 3" in capsys.readouterr().err
    assert not (tmp_path / "demo" / "logs" / "02-second.done").exists()


def test_the_export_stage_is_redone_when_its_directory_is_gone(tmp_path):
    from pretrain.export.export_record import EXPORT_RECORD

    flow = quickstart.Flow(tmp_path, 2, quickstart.PROMPT)
    index, export = next((i, s) for i, s in enumerate(quickstart.STAGES, 1) if s.name == "export")
    flow.logs.mkdir()
    quickstart.done_file(flow, index, export).write_text("ok: max |Δlogit| 0 -> hf\n")
    assert quickstart.finished_earlier(flow, index, export) is None
    flow.hf.mkdir()
    (flow.hf / EXPORT_RECORD).write_text(json.dumps({"files": ["config.json"]}))
    assert quickstart.finished_earlier(flow, index, export) is None  # a file it wrote is gone
    (flow.hf / "config.json").write_text("{}")
    assert quickstart.finished_earlier(flow, index, export) == "ok: max |Δlogit| 0 -> hf"


@pytest.mark.slow
def test_training_progress_is_shown_while_the_stage_runs(tmp_path, monkeypatch, capsys):
    """The stand-in 'training' appends records to metrics.jsonl over a second; each poll prints the
    latest train record and every evaluation, and the log file keeps the command's own output."""
    monkeypatch.setattr(quickstart, "PROGRESS_SECONDS", 0.1)
    flow = quickstart.Flow(tmp_path, 2, quickstart.PROMPT)
    flow.run.mkdir()
    records = [TrainRecord(step=10, loss=5.5, lr=1e-3, grad_norm=1.0, tokens_per_s=1234.0, step_time_s=0.1,
                           skipped_steps=0, trainable_params=10, peak_mem_bytes=1),
               EvalRecord(step=10, split="valid", loss=5.25, ppl=190.6)]
    script = "; ".join(f"echo {shlex.quote(json.dumps(asdict(r)))} >> {shlex.quote(str(RunDir(flow.run).metrics))}; "
                       "echo trained; sleep 0.5" for r in records)
    training = quickstart.Stage("pretrain", lambda f: ["sh", "-c", script], lambda f, out: "trained",
                                lambda f: [], progress=lambda f: quickstart.TrainingProgress(f.run))
    assert quickstart.run_flow(flow, [training]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[1/1] pretrain  running, progress below (log: " + str(flow.logs / "01-pretrain.log") + ")"
    assert out[1:3] == ["      step 10: train loss 5.500, 1,234 tokens/s",
                        "      step 10: valid loss 5.250 (ppl 190.6)"]
    assert out[3].startswith("[1/1] pretrain  trained")
    assert (flow.logs / "01-pretrain.log").read_text().splitlines()[1:] == ["trained", "trained"]


def test_next_steps_name_the_commands_of_this_demo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = quickstart.next_steps(quickstart.Flow(tmp_path / "runs" / "demo", 2, "def main("))
    for command in ("cat runs/demo/run/summary.json", "tensorboard --logdir runs/demo/run/tensorboard",
                    "python -m pretrain.export.convert_to_hf --run-dir runs/demo/run --output runs/demo/hf",
                    "python -m pretrain.export.generate --hf runs/demo/hf --prompt 'def main('",
                    "python -m data_tools.build_shards", "DATA_MANIFEST=SHARDS/manifest.json launch/pretrain_ora.sh",
                    "--tokenizer runs/demo/tokenizer/sp.model --output-dir FT_SHARDS",
                    "--set init_from.path=runs/demo/hf --set init_from.qk=imported", "make test-fast"):
        assert command in text, command
