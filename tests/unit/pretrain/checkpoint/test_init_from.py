"""init_from.path in one process: Hugging Face models written by transformers import with transformers'
logits, or are refused naming the setting; a shape, family or format mismatch is refused naming the
tensor; init_from.qk draws or imports Q/K; and the imported weights reach a DeepSpeed engine
with its fp32 masters."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from one_process import optimizer_steps
from pretrain_runs import arguments, forbid_workers, write_config

from ora_megatron.model_config import AttentionConfig, ModelConfig
from pretrain import pretrain_ora
from pretrain.checkpoint import reshard
from pretrain.checkpoint.consolidate import reference_model, tp1_parallel_state
from pretrain.checkpoint.import_plan import plan_import
from pretrain.config.init_from import ImportRefused, InitFromConfig
from pretrain.config.run_config import RunConfig
from pretrain.config.runtime_sections import DeepSpeedConfig, LoggingConfig

VOCAB, HIDDEN, HEADS, LAYERS = 96, 32, 4, 2


def hf_model(family: str, **config):
    """A random transformers model of a small size, every other setting transformers' default, its
    weights moved off their init (biases and norms too) so that every mapping error shows."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, **config))
    else:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                                             num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=VOCAB,
                                             **config))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def run_config(family: str, source, attention: str = "vanilla", qk=None, **model) -> RunConfig:
    """The run's model as transformers' defaults size it: GPT-2's 1024 positions, llama's head_dim."""
    sizes = dict(family=family, num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                 make_vocab_size_divisible_by=64, hidden_dropout=0.0, attention_dropout=0.0,
                 seq_length=1024 if family == "gpt2" else 64, attention=AttentionConfig(type=attention))
    if family == "llama":
        sizes.update(num_query_groups=2, ffn_hidden_size=64)
    sizes.update(model)
    return RunConfig(model=ModelConfig(**sizes), init_from=InitFromConfig(path=str(source), qk=qk),
                     logging=LoggingConfig(tensorboard=False, wandb_mode="disabled", progress=False))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family → (transformers model, the directory save_pretrained wrote)."""
    root = tmp_path_factory.mktemp("hf_models")
    models = {}
    for name, family, config in (("gpt2", "gpt2", {}), ("llama", "llama", {}),
                                 ("llama-tied", "llama", {"tie_word_embeddings": True})):
        model = hf_model(family, **config)
        model.save_pretrained(root / name)
        models[name] = (model, root / name)
    return models


def our_logits(plan, tokens: torch.Tensor) -> torch.Tensor:
    model = reference_model(plan.cfg.model)
    model.load_state_dict(plan.state, strict=False)
    with tp1_parallel_state(), torch.no_grad():
        return model.eval()(tokens)[..., :VOCAB]


@pytest.mark.slow  # a transformers model is built and saved once for the module (seconds)
@pytest.mark.parametrize("name, taken_over", [("gpt2", {"model.activation": [None, "gelu_tanh"]}),
                                              ("llama", {"model.layernorm_epsilon": [1e-5, 1e-6]}),
                                              ("llama-tied", {"model.layernorm_epsilon": [1e-5, 1e-6]})])
def test_a_model_transformers_saved_computes_transformers_logits(saved, name, taken_over):
    """Default configs: GPT-2's tanh GELU and Llama's RMSNorm epsilon 1e-6 are taken over; a tied Llama's
    output head is its embedding (which transformers leaves out of the file)."""
    model, path = saved[name]
    family = name.split("-")[0]
    plan = plan_import(run_config(family, path))
    assert plan.record["taken_over"] == taken_over and plan.record["kind"] == "hugging_face"
    assert set(plan.record["files"]) == {"config.json", "model.safetensors"}
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
    assert (our_logits(plan, tokens) - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("family, setting, field", [
    ("gpt2", {"activation_function": "relu"}, "activation_function"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"n_head": 2}, "n_head"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters.rope_type"),
    ("llama", {"num_key_value_heads": 4}, "num_key_value_heads"),
])
def test_a_setting_the_model_cannot_compute_is_refused_naming_it(tmp_path, family, setting, field):
    write_hf_config(tmp_path, family, **setting)  # config.json alone: refused before any weight is read
    with pytest.raises(ImportRefused, match=f"config.json: {field}: "):
        plan_import(run_config(family, tmp_path))


def write_hf_config(path, family: str, **setting) -> None:
    """A config.json as transformers writes one (the keys that matter here)."""
    if family == "gpt2":
        config = dict(model_type="gpt2", n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB,
                      activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True)
    else:
        config = dict(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=2, vocab_size=VOCAB, hidden_act="silu", rms_norm_eps=1e-6,
                      rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    (path / "config.json").write_text(json.dumps({**config, **setting}))


@pytest.mark.slow  # a transformers model is built and saved once for the module (seconds)
@pytest.mark.parametrize("family, change, tensor", [
    ("gpt2", {"ffn_hidden_size": 64}, "transformer.h.0.mlp.c_fc.bias has shape [128], the run's model needs [64]"),
    ("gpt2", {"seq_length": 128}, "transformer.wpe.weight has shape [1024, 32], the run's model needs [128, 32] "
                                  "(model.seq_length must equal n_positions)"),
    ("gpt2", {"vocab_size": 100}, "transformer.wte.weight has shape [96, 32], the run's model needs [100, 32]"),
    ("llama", {"num_layers": 3}, "the weights lack model.layers.2.input_layernorm.weight"),
    ("llama", {"kv_channels": 16}, "model.layers.0.self_attn.o_proj.weight has shape [32, 32], the run's model "
                                   "needs [32, 64]"),
])
def test_a_shape_mismatch_is_refused_naming_the_first_tensor(saved, family, change, tensor):
    with pytest.raises(ImportRefused, match=re.escape(tensor)):
        plan_import(run_config(family, saved[family][1], **change))


@pytest.mark.slow  # a transformers model is built and saved once for the module (seconds)
def test_refusals_reach_the_entry_before_any_worker(saved, tmp_path, capsys, monkeypatch):
    """The entry's refusal path: status 2, the message, no worker, no run dir."""
    forbid_workers(monkeypatch)
    config = write_config(tmp_path)  # TINY_RUN: gpt2 d=64, ORA
    cases = [([f"init_from.path={saved['gpt2'][1]}", "init_from.qk=draw"],
              "transformer.wte.weight has shape [96, 32], the run's model needs [256, 64]"),
             ([f"init_from.path={saved['llama'][1]}", "init_from.qk=draw"],
              "config error at 'model.family': gpt2, but"),
             ([f"init_from.path={tmp_path / 'nowhere'}", "init_from.qk=draw"], "does not exist"),
             ([f"init_from.path={saved['gpt2'][1]}"], "config error at 'init_from.qk'"),
             (["init_from.qk=imported"], "config error at 'init_from.qk': read only with"),
             ([f"init_from.path={saved['gpt2'][1]}", "model.attention.type=synthesizer_random"],
              "config error at 'init_from.path': attention type 'synthesizer_random'"),
             ([f"init_from.path={saved['gpt2'][1]}", "init_from.qk=draw", "model.attention.type=vanilla"],
              "config error at 'init_from.qk': read only for random-Q/K attention")]
    for overrides, message in cases:
        assert pretrain_ora.main(arguments(config, tmp_path / "never", overrides)) == 2, overrides
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        assert not (tmp_path / "never").exists()


def test_pickled_weights_are_refused_naming_the_file(tmp_path):
    write_hf_config(tmp_path, "gpt2")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ImportRefused, match="as pytorch_model.bin \\(pickle\\), which can run code"):
        plan_import(run_config("gpt2", tmp_path))


@pytest.mark.slow  # a transformers model is built and saved once for the module (seconds)
def test_the_qk_choice_draws_or_imports(saved):
    """ORA from a vanilla Llama: `draw` keeps the run's orthonormal Q/K, `imported` takes the model's;
    V, the MLP and the rest come from the model either way."""
    model, path = saved["llama"]
    source = dict(model.state_dict())
    draws = reference_model(run_config("llama", path, "ora", "draw").model).state_dict()
    for choice in ("draw", "imported"):
        state = plan_import(run_config("llama", path, "ora", choice)).state
        for i in range(LAYERS):
            ours, theirs = f"layer{i + 1}.layer.self_attention.linear_qkv.", f"model.layers.{i}.self_attn."
            assert torch.equal(state[ours + "v_weight"], source[theirs + "v_proj.weight"])
            for role in "qk":
                got = state[f"{ours}{role}_weight"]
                if choice == "draw":
                    assert torch.equal(got, draws[f"{ours}{role}_weight"])
                    per_head = got.view(-1, HIDDEN // HEADS, HIDDEN)  # each head's rows: orthonormal
                    gram = per_head @ per_head.transpose(1, 2)
                    assert torch.allclose(gram, torch.eye(HIDDEN // HEADS).expand_as(gram), atol=1e-5)
                else:
                    assert torch.equal(got, source[f"{theirs}{role}_proj.weight"])
        assert torch.equal(state["layer1.layer.mlp.linear_fc2.weight"], source["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.slow  # a transformers model is built and saved once for the module (seconds)
def test_imported_q_bias_that_ora_cannot_hold_is_refused(saved):
    with pytest.raises(ImportRefused, match="init_from.qk': imported, but the source's Q bias "
                                            "\\(transformer.h.0.attn.c_attn.bias\\) is nonzero"):
        plan_import(run_config("gpt2", saved["gpt2"][1], "ora", "imported"))


@pytest.mark.slow  # a transformers model is built and saved once for the module (seconds)
def test_imported_weights_and_fp32_masters_reach_an_engine(saved, one_process_group):
    """The workers' load (reshard.load_weights) in a ZeRO-1 bf16 engine: the module holds the weights
    (rounded to bf16), the optimizer's fp32 masters exactly; a step starts from them."""
    from pretrain.runtime.ds_internals import full_fp32_master, whole_tensor_masters
    from pretrain.runtime.engine import build_engine

    plan = plan_import(run_config("llama", saved["llama"][1], "ora", "imported"))
    cfg = dataclasses.replace(plan.cfg, train=dataclasses.replace(plan.cfg.train, micro_batch_size=2,
                                                                  global_batch_size=2),
                              deepspeed=DeepSpeedConfig(zero_stage=1, precision="bf16"))
    engine = build_engine(cfg, grad_accum=1)
    assert reshard.load_weights(engine, plan.state) == len(list(engine.named_parameters()))
    masters = whole_tensor_masters(engine.ds_engine)
    for name, param in engine.named_parameters():
        assert torch.equal(param.detach().float(), plan.state[name].to(torch.bfloat16).float()), name
        if param.requires_grad:
            assert torch.equal(full_fp32_master(param, masters).cpu(), plan.state[name]), name
    optimizer_steps(engine, 1)
    q = dict(engine.named_parameters())["layer1.layer.self_attention.linear_qkv.q_weight"]
    assert not q.requires_grad and torch.equal(q.float(), plan.state[
        "layer1.layer.self_attention.linear_qkv.q_weight"].to(torch.bfloat16).float())
