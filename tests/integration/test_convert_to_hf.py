"""Hugging Face export: verified parity for gpt2 and llama from every layout, layout-independent
weights, a wrong mapping caught, the tokenizer, generation, and refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sentencepiece
import torch
from manifest_runs import manifest_run
from pretrain_runs import LAYOUT_WEIGHT_ATOL, REPO, write_config
from pretrain_runs import LAYOUTS as RUN_LAYOUTS
from safetensors.torch import load_file

from ora_megatron.families import gpt2_hf, llama_hf
from pretrain.export.convert_to_hf import ExportError, export, main
from pretrain.run_files.run_dir import RunDir

pytestmark = pytest.mark.distributed

FAMILIES = {"gpt2": [], "llama": ["model.family=llama", "model.num_query_groups=2"]}
# name: (overrides, processes). On gpt2 these are the suite's shared runs of TINY_RUN (the one-process
# reference and LAYOUTS' tp2-zero1, pp2-zero1 and dp2-zero3, and bf16-zero1): the same overrides, in
# the same order, so that each is trained once.
LAYOUTS = {
    "tp1": ([], 1),
    "tp2": (RUN_LAYOUTS["tp2-zero1"], 2),
    "pp2": (RUN_LAYOUTS["pp2-zero1"], 2),
    "zero3": (["deepspeed.zero_stage=3"], 2),
    "bf16": (["deepspeed.zero_stage=1", "deepspeed.precision=bf16"], 2),
}
# The llama family's own mapping (GQA, gated MLP, RoPE) meets the layouts where tensor parallelism
# splits it; pipeline stages, ZeRO partitions and bf16 are read the same for both families.
CASES = [("gpt2", layout) for layout in LAYOUTS] + [("llama", "tp1"), ("llama", "tp2")]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "  two  spaces\tand a tab\n",
         "Déjà vu, naïve café", "東京と大阪", "emoji 🚀👩‍💻", ""]


@pytest.fixture(scope="module")
def runs(trained_runs):
    """Each family × layout: TINY_RUN trained 6 steps on mock data (the export verifies on its
    validation samples and random tokens)."""
    return {(family, layout): trained_runs.trained(FAMILIES[family] + LAYOUTS[layout][0], nproc=LAYOUTS[layout][1])
            for family, layout in CASES}


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory):
    """(family, layout) → (export dir, verification figures)."""
    root = tmp_path_factory.mktemp("hf_dirs")
    return {case: (root / "-".join(case), export(RunDir(run_dir), root / "-".join(case)))
            for case, run_dir in runs.items()}


@pytest.fixture(scope="module")
def real_data_export(trained_runs, shards, tmp_path_factory):
    """(export dir, verification figures) of the suite's run on real data: a llama with Hadamard Q/K
    and the shards' sentencepiece tokenizer."""
    out = tmp_path_factory.mktemp("hf_real_data") / "hf"
    return out, export(RunDir(manifest_run(trained_runs, shards)), out)


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_export_matches_the_source_model(exports, case):
    out, figures = exports[case]
    print(case, figures)
    assert figures["passed"], figures
    assert figures["max_abs_logit"] <= 1e-4 and figures["mean_kl"] <= 1e-9
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()


@pytest.mark.parametrize("case", [c for c in CASES if c[1] in ("tp2", "pp2", "zero3")], ids="-".join)
def test_exported_weights_do_not_depend_on_the_layout(exports, case):
    single = load_file(exports[case[0], "tp1"][0] / "model.safetensors")
    other = load_file(exports[case][0] / "model.safetensors")
    assert single.keys() == other.keys()
    for name, tensor in single.items():
        assert (tensor - other[name]).abs().max() <= LAYOUT_WEIGHT_ATOL, name


@pytest.mark.parametrize("family, wrong", [
    ("gpt2", "swap_qk"), ("llama", "swap_qk"), ("llama", "permute_rope"),
])
def test_a_wrong_mapping_fails_verification(runs, tmp_path, monkeypatch, family, wrong):
    mapping = {"gpt2": gpt2_hf, "llama": llama_hf}[family]
    right = mapping.hf_state_dict

    def wrong_state_dict(state, model):
        out = right(state, model)
        for i in range(model.num_layers):
            if family == "gpt2":
                w = out[f"transformer.h.{i}.attn.c_attn.weight"]
                d = model.hidden_size
                out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([w[:, d:2 * d], w[:, :d], w[:, 2 * d:]], 1)
            elif wrong == "swap_qk":  # K has fewer heads under GQA: swap the first K-sized block of rows
                q, k = (out[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qk")
                q2 = torch.cat([k, q[k.size(0):]])
                out[f"model.layers.{i}.self_attn.q_proj.weight"] = q2
                out[f"model.layers.{i}.self_attn.k_proj.weight"] = q[: k.size(0)]
            else:  # the interleaved↔halves RoPE permutation other converters apply
                for p in "qk":
                    w = out[f"model.layers.{i}.self_attn.{p}_proj.weight"]
                    heads, hd = w.size(0) // model.head_dim, model.head_dim
                    out[f"model.layers.{i}.self_attn.{p}_proj.weight"] = (
                        w.view(heads, hd // 2, 2, -1).transpose(1, 2).reshape(w.shape))
        return out

    monkeypatch.setattr(mapping, "hf_state_dict", wrong_state_dict)
    figures = export(RunDir(runs[family, "tp1"]), tmp_path / "wrong")
    print(family, wrong, figures)
    assert not figures["passed"]
    assert (tmp_path / "wrong.unverified").is_dir() and not (tmp_path / "wrong").exists()


def test_bf16_export_verifies_and_holds_bf16_weights(runs, tmp_path):
    figures = export(RunDir(runs["gpt2", "bf16"]), tmp_path / "bf16", dtype="bf16")
    assert figures["passed"], figures
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "bf16" / "model.safetensors").values())


def test_tokenizer_and_generation_from_the_export(real_data_export, shards):
    from transformers import AutoTokenizer, pipeline

    out = real_data_export[0]
    sp = sentencepiece.SentencePieceProcessor(model_file=str(shards.parent / "tok" / "sp.model"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == sp.encode(text), text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (sp.bos_id(), sp.eos_id())
    sample = subprocess.run([sys.executable, "-m", "pretrain.export.generate", "--hf", str(out), "--prompt", "The",
                             "--max-new-tokens", "8"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert sample.startswith("The") and len(sample.strip()) > len("The")
    generated = pipeline("text-generation", model=str(out))("The", max_new_tokens=5, do_sample=False)
    assert generated[0]["generated_text"].startswith("The")


def test_model_card_names_frozen_qk(exports):
    card = (exports["gpt2", "tp1"][0] / "README.md").read_text()
    assert "GPT2LMHeadModel" in card and "layer1.Q" in card and "layer2.K" in card
    assert "steps: 6" in card


@pytest.mark.parametrize("attention", ["synthesizer_random", "synthesizer_factorized", "fixed_random_attention"])
def test_variants_without_hf_architecture_are_refused_before_writing(tmp_path, attention):
    from ora_megatron.config_io import to_dict
    from pretrain.config.run_config import load_run_config

    config = write_config(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    overrides = [f"model.attention.type={attention}", "model.attention.synthesizer_rank=4"]
    run_dir.write_config(to_dict(load_run_config(str(config), overrides)))
    with pytest.raises(ExportError, match="no Hugging Face architecture"):
        export(run_dir, tmp_path / "out")
    assert main(["--run-dir", str(run_dir.path), "--output", str(tmp_path / "out")]) == 2
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_hadamard_qk_are_exported_as_dense_matrices(real_data_export):
    """Our model applies frozen Hadamard Q/K as a fast transform; the export holds them as matrices."""
    out, figures = real_data_export
    assert "attention `ora` (hadamard)" in (out / "README.md").read_text()
    assert figures["passed"], figures
