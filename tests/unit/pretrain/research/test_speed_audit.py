"""The op audit against a reference GPT: a tiny GPT-like stand-in (written here, nanoGPT's interface) traced
as its trainer runs it, its categories, a difference it must show, and the side-by-side report."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pretrain.research.speed.audit import CATEGORIES, audit, ours, reference, table
from pretrain.research.speed.changes import step_ms
from pretrain.research.speed.code_versions import foreach_launches
from pretrain.research.speed.gpus import GPU_KINDS
from pretrain.research.speed.step_time import load_config, step_time

H200 = GPU_KINDS["h200"]

STAND_IN = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class GPTConfig:  # nanoGPT's fields: block_size, vocab_size, n_layer, n_head, n_embd, dropout, bias
    def __init__(self, **fields):
        self.__dict__.update(fields)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.mlp_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.drop = nn.Dropout(c.dropout)
        self.heads, self.p = c.n_head, c.dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0, is_causal=True)
        y = self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d)))EXTRA
        x = x + y
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1))
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
'''


def stand_in(tmp_path: Path, name: str, extra: str = "") -> Path:
    path = tmp_path / name / "model.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(STAND_IN).replace("EXTRA", extra))
    return path


@pytest.fixture(scope="module")
def cfg():
    # The tiny preset with dropout, vanilla attention: 2 layers, width 64, 4 heads, seq 64, vocab 2048.
    return load_config("tiny", ["model.attention.type=vanilla", "model.hidden_dropout=0.1",
                                "model.attention_dropout=0.1"])


def kernels(side, compiled: bool = False) -> dict[str, int]:
    return {name: c.kernels for name, c in side.costs(H200, compiled).categories.items()}


def test_reference_step_has_each_category_as_its_trainer_launches_it(cfg, tmp_path: Path):
    side = reference(cfg, stand_in(tmp_path, "plain"), 8, cache=None)
    counts = kernels(side)
    layers, micro_batches = 2, side.micro_batches
    assert micro_batches == 2  # 16 samples a step at micro-batch 8
    assert counts["attention"] == 2 * layers * micro_batches  # one flash kernel each way a layer
    assert counts["norms"] == (2 * layers + 1) * 3 * micro_batches  # forward, and backward's two kernels
    assert counts["dropout"] == (2 * layers + 1) * 2 * micro_batches  # native_dropout and its backward
    assert counts["activations"] == 2 * layers * micro_batches
    # Linears: one forward, two backward (input and weight); the tied head's too.
    assert counts["gemm"] == (4 * layers + 1) * 3 * micro_batches
    assert counts["loss"] > 0 and counts["optimizer"] > 0 and counts["casts_copies"] > 0
    assert set(counts) == set(CATEGORIES)


def test_one_extra_cast_in_the_reference_shows_as_one_more_cast_kernel(cfg, tmp_path: Path):
    plain = kernels(reference(cfg, stand_in(tmp_path, "plain"), 8, cache=None))
    cast = kernels(reference(cfg, stand_in(tmp_path, "cast", extra=".float()"), 8, cache=None))
    # bf16 → fp32 after each layer's attention (2 layers, 2 micro-batches). Backward casts the fp32 residual
    # gradient to bf16 once either way: in the cast's backward here, in the fp32 + bf16 add's before.
    assert cast["casts_copies"] - plain["casts_copies"] == 2 * 2
    assert {k: v for k, v in cast.items() if k != "casts_copies"} == {
        k: v for k, v in plain.items() if k != "casts_copies"}


def test_compiled_reference_fuses_the_memory_bound_runs(cfg, tmp_path: Path):
    side = reference(cfg, stand_in(tmp_path, "plain"), 8, cache=None)
    eager, compiled = side.costs(H200, False), side.costs(H200, True)
    assert compiled.categories["gemm"].kernels == eager.categories["gemm"].kernels
    assert compiled.categories["norms"].kernels < eager.categories["norms"].kernels
    memory_bound = ("norms", "activations", "dropout", "casts_copies", "loss", "rest")
    assert sum(compiled.categories[c].kernels for c in memory_bound) < sum(
        eager.categories[c].kernels for c in memory_bound)
    assert compiled.step_s < eager.step_s


def test_our_side_is_the_speed_models_step(cfg, tmp_path: Path):
    for compiled in (False, True):
        audited = ours(cfg, 8, "HEAD", cache=tmp_path).costs(H200, compiled)
        modeled = step_time(cfg, H200, 8, compiled, "HEAD", cache=tmp_path)
        assert audited.step_s == pytest.approx(modeled.seconds)
        assert sum(c.kernels for c in audited.categories.values()) == (
            modeled.micro_batches * modeled.micro_batch.kernels + modeled.optimizer.kernels)


def test_report_puts_both_sides_side_by_side_per_category(cfg, tmp_path: Path):
    report = audit(cfg, "tiny", "h200", stand_in(tmp_path, "plain"), 8, cache=tmp_path)
    for sides in report["modes"].values():
        assert set(sides["ours"]["categories"]) == set(sides["reference"]["categories"]) == set(CATEGORIES)
        assert sides["ratio"] == pytest.approx(sides["ours"]["step_ms"] / sides["reference"]["step_ms"])
    assert "measured" not in report  # the GPU measured Small and Base only
    text = table(report)
    assert "eager: ours ÷ reference" in text and "casts_copies" in text


def test_a_reference_without_nanogpts_classes_is_refused(cfg, tmp_path: Path):
    path = tmp_path / "model.py"
    path.write_text("class GPT: pass\n")
    with pytest.raises(ValueError, match="GPTConfig"):
        reference(cfg, path, 8, cache=None)


def test_foreach_launches_by_tensor_count_and_blocks():
    assert foreach_launches([1] * 110, 1) == 1 and foreach_launches([1] * 111, 1) == 2
    assert foreach_launches([1] * 37, 4) == 2
    assert foreach_launches([320 * 65536 + 1], 1) == 2


def test_fused_adamw_and_cuda_graphs_save_what_they_remove(cfg, tmp_path: Path):
    def step(compiled, fused_adamw, cuda_graphs):
        return step_ms(cfg, H200, 8, compiled, fused_adamw, cuda_graphs, cache=tmp_path)

    foreach, fused = step(False, False, False), step(False, True, False)
    assert fused["step_ms"] < foreach["step_ms"]  # fewer optimizer kernels and bytes
    plain, graphed = step(True, True, False), step(True, True, True)
    # The compiled loss's chunk kernels leave the host's time; the device's is the same.
    assert graphed["micro_batch_host_ms"] < plain["micro_batch_host_ms"]
    assert graphed["micro_batch_device_ms"] == plain["micro_batch_device_ms"]
    assert graphed["step_ms"] <= plain["step_ms"]


def test_the_reference_step_is_profiled_as_its_trainer_runs_it(tmp_path: Path, capsys):
    """Without CUDA the profile is a dry run on the CPU: the trainer's step runs (the weights move), the
    trace is written and its breakdown names the device and finds no kernels."""
    import json

    import torch

    from pretrain.research.speed.audit import reference_shape
    from pretrain.research.speed.reference import build_reference
    from pretrain.research.speed.reference_profile import main, reference_optimizer, reference_step

    path = stand_in(tmp_path, "profiled")
    shape_cfg = load_config("tiny", ["model.attention.type=vanilla"])
    model = build_reference(path, reference_shape(shape_cfg))
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(64, (2, 64))
    reference_step(model, reference_optimizer(model, tokens.device), tokens, tokens, accumulation=2)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    out = tmp_path / "out"
    assert main(["--reference", str(path), "--config", "tiny", "--out", str(out), "--micro-batch", "2",
                 "--steps", "1", "--set", "model.attention.type=vanilla"]) == 0
    result = json.loads((out / "reference-tiny.breakdown.json").read_text())
    assert (out / "reference-tiny.json.gz").is_file()
    assert result["device"] == "cpu" and result["micro_batch"] == 2 and result["accumulation"] >= 1
    assert result["breakdown"]["kernels_per_step"] == 0
    assert "reference-tiny.json.gz" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--reference", str(tmp_path / "absent.py"), "--out", str(out)])
    with pytest.raises(SystemExit):  # a config error names its key, before anything is built or written
        main(["--reference", str(path), "--config", "tiny", "--out", str(tmp_path / "bad"), "--set", "model.nope=1"])
    assert "model.nope" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_reference_predictions_go_with_the_next_window(capsys):
    from pretrain.research.speed.validate import main as validate_main

    with pytest.raises(SystemExit) as refused:
        validate_main(["--reference", "model.py"])
    assert refused.value.code == 2 and "--reference goes with --next-window" in capsys.readouterr().err
