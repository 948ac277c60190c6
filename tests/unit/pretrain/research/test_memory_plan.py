"""pretrain/research/memory_model.py against what DeepSpeed allocates and what the model keeps for backward;
the memory_plan CLI."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch
from distributed import run_on_ranks

from ora_megatron.parallel import destroy_distributed, init_distributed
from ora_megatron.stages import build_staged_gpt
from pretrain.config.run_config import load_run_config
from pretrain.paths import REPO
from pretrain.research import memory_model, memory_plan

# Hidden size 385 (5 heads of 77): the Q/K/V/MLP matrices exceed ZeRO-3's 1e5-element persistence
# threshold (so they are partitioned), the embedding stays under it, and odd sizes make DeepSpeed pad
# (ZeRO-1/2 groups to 2·dp elements, ZeRO-3 parameters to a multiple of dp).
RUN = """
model:
  num_layers: 2
  hidden_size: 385
  num_attention_heads: 5
  seq_length: 32
  vocab_size: 256
  hidden_dropout: 0.0
  attention_dropout: 0.0
  attention: {type: ora}
train: {micro_batch_size: 4, global_batch_size: 8, steps: 2}
data: {mock: true}
"""
LAYOUTS = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (1, "bf16"), (3, "bf16")]
# Besides model states and DeepSpeed's buffers, a rank holds a few scalars between steps (loss,
# gradient norm, overflow flag, step counters): about 1 KiB measured.
SCALARS = 4096
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def overrides(zero: int, precision: str) -> list[str]:
    return [f"deepspeed.zero_stage={zero}", f"deepspeed.precision={precision}"]


@pytest.fixture(scope="module")
def run_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("memory_plan") / "run.yaml"
    path.write_text(RUN)
    return str(path)


@pytest.fixture
def one_process():
    init_distributed(1, 1)
    yield
    destroy_distributed()


# ---------------------------------------------------------------- what DeepSpeed allocates, per rank
def _storages(tensors) -> dict[int, int]:
    """Bytes per distinct storage (views of one buffer count once)."""
    out = {}
    for t in tensors:
        if t is not None and t.device.type != "meta" and t.untyped_storage().nbytes():
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor the process can reach from Python (autograd's saved tensors excepted). Garbage in
    reference cycles is collected first: it holds memory only until the next collection, at no set time."""
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


class StateReader:
    """Sorts a rank's live tensor bytes into weights, fp32 masters, Adam moments and the rest
    (gradients, DeepSpeed's buffers), keeping the reading where the rest peaks."""

    def __init__(self, ds_engine, before: list[torch.Tensor]):
        from pretrain.runtime.ds_internals import base_optimizer, optimizer_flat_params

        # Held, not just remembered: a freed storage's address could be reused by a new one.
        self.before, self.baseline = before, _storages(before).keys()
        self.engine = ds_engine
        self.params = list(ds_engine.module.parameters())
        self.flats = [flat for flat, _ in optimizer_flat_params(ds_engine)]
        self.optimizer = base_optimizer(ds_engine)
        self.peak: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        # ZeRO-3 keeps this rank's partition in ds_tensor; the parameter is empty between uses.
        weights = _storages(getattr(p, "ds_tensor", p) for p in self.params)
        masters = {k: v for k, v in _storages(self.flats).items() if k not in weights}
        state = self.optimizer.state
        moments = _storages(state[f].get(key) for f in self.flats if f in state for key in ("exp_avg", "exp_avg_sq"))
        counted = self.baseline | weights.keys() | masters.keys() | moments.keys()
        rest = sum(v for k, v in _storages(_live_tensors()).items() if k not in counted)
        return {"weights": sum(weights.values()), "master_weights": sum(masters.values()),
                "adam_moments": sum(moments.values()), "rest": rest}

    def record(self, *_hook_args, to_come: int = 0) -> None:
        reading = self.read()
        reading["rest"] += to_come
        if reading["rest"] >= self.peak.get("rest", 0):
            self.peak = reading

    def watch_flatten(self) -> None:
        """ZeRO's step flattens each group's gradient partition and converts it to fp32 at once
        (`self.flatten(...).to(fp32)`): read between the two, counting the fp32 copy about to be made."""
        optimizer = self.engine.optimizer
        flatten = optimizer.flatten

        def flatten_and_read(tensors):
            flat = flatten(tensors)
            self.record(to_come=0 if flat.dtype == torch.float32 else memory_model.FP32 * flat.numel())
            return flat

        optimizer.flatten = flatten_and_read

    def gathered_bytes(self) -> int:
        """Bytes of full parameters a ZeRO-3 rank holds right now (gathered for forward/backward)."""
        return sum(p.numel() * p.element_size() for p in self.params)


def _batch() -> dict:
    tokens = torch.randint(0, 256, (4, 32))
    return {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(4, 32)}


def _measure_layout(path: str, zero: int, precision: str) -> dict:
    """Two steps (Adam state exists from the first); the second is read after forward, inside backward
    (when the last gradient arrives), after backward, and in the step (each flatten of a gradient
    partition, and before each optimizer step)."""
    from pretrain.runtime.engine import build_engine
    from pretrain.runtime.loss import batch_loss

    cfg = load_run_config(path, overrides(zero, precision))
    before = _live_tensors()
    ds_engine = build_engine(cfg, grad_accum=1).ds_engine
    reader = StateReader(ds_engine, before)
    seen: dict[str, int] = {}
    for step in range(2):
        loss = batch_loss(ds_engine, _batch())
        if step == 1:
            seen["gathered_after_forward"] = reader.gathered_bytes()
            if zero in (1, 2):  # the embedding's gradient arrives last in backward
                def largest_in_backward(_param) -> None:
                    seen["largest_in_backward"] = max(_storages(_live_tensors()).values())

                reader.params[0].register_post_accumulate_grad_hook(largest_in_backward)
        ds_engine.backward(loss)
        if step == 1:
            reader.record()
            reader.optimizer.register_step_pre_hook(reader.record)
            if zero > 0:
                reader.watch_flatten()
        ds_engine.step()
    ds_engine.destroy()
    return {**reader.peak, **seen}


def _measure(rank: int, path: str) -> list[dict]:
    return [_measure_layout(path, zero, precision) for zero, precision in LAYOUTS]


@pytest.fixture(scope="module")
def measured(run_config) -> list[list[dict]]:
    """Per rank, per layout: the live bytes on 2 gloo ranks (DP=2)."""
    return run_on_ranks(_measure, 2, run_config)


@pytest.fixture(scope="module")
def planned(run_config) -> list[dict]:
    init_distributed(1, 1)
    try:
        return [memory_model.plan(load_run_config(run_config, overrides(*layout)), world_size=2) for layout in LAYOUTS]
    finally:
        destroy_distributed()


@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"zero{z}-{p}" for z, p in LAYOUTS])
def test_model_states_are_what_deepspeed_allocates(measured, planned, index):
    zero, precision = LAYOUTS[index]
    expected, ranks = planned[index], [per_rank[index] for per_rank in measured]
    for key in ("weights", "master_weights", "adam_moments"):
        assert [r[key] for r in ranks] == [expected["bytes"][key]] * 2, key
    # Gradient storage peaks on the rank whose ZeRO-1/2 partition overlaps the most whole parameters;
    # ZeRO-3's reduce bucket is allocated at initialisation and stays.
    persistent = expected["deepspeed_buffers"]["reduce_bucket"] if zero == 3 else 0
    rest = max(r["rest"] for r in ranks) - persistent
    assert 0 <= rest - expected["bytes"]["gradients"] <= SCALARS


@pytest.mark.distributed
@pytest.mark.parametrize("index", [i for i, (zero, _) in enumerate(LAYOUTS) if zero in (1, 2, 3)],
                         ids=[f"zero{z}-{p}" for z, p in LAYOUTS if z in (1, 2, 3)])
def test_deepspeed_buffers_are_what_deepspeed_allocates(measured, planned, index):
    zero, _ = LAYOUTS[index]
    expected = planned[index]["deepspeed_buffers"]
    for rank in measured:
        if zero == 3:  # the whole model stays gathered from forward to backward (reuse distance 1e9)
            assert rank[index]["gathered_after_forward"] == expected["zero3_gathered_parameters"]
        else:  # the reduce bucket is the largest tensor alive during backward
            assert rank[index]["largest_in_backward"] == expected["reduce_bucket"]


def test_pipeline_stages_hold_their_layers_and_a_tied_embedding_each(one_process, run_config):
    """PP=2 over 2 layers: one layer per stage; gpt2's tied embedding lives on both end stages."""
    cfg = load_run_config(run_config, ["parallel.pipeline=2"])
    model = build_staged_gpt(cfg.model, cfg.parallel)
    embedding = sum(p.numel() for p in model.embedding.parameters())
    stages = memory_model.stage_shards(cfg, memory_model.pipeline_stages(cfg.model, cfg.parallel))
    frozen = [sum(s.numel for s in stage if not s.trainable) for stage in stages]
    assert frozen == [2 * 385 * 385] * 2  # one layer's Q and K on each stage
    assert sum(s.numel for stage in stages for s in stage) == sum(p.numel() for p in model.parameters()) + embedding


@pytest.mark.parametrize("method", ["qr", "hadamard"])
def test_the_meta_model_counts_frozen_qk_of_every_orthogonal_method(one_process, run_config, method):
    """The plan's model is built on the meta device: ORA's Q/K (hadamard's transforms too) are not drawn
    there, yet counted as the real model has them, frozen."""
    cfg = load_run_config(run_config, [f"model.attention.orthogonal_method={method}", "model.hidden_size=256",
                                       "model.num_attention_heads=4"])
    (shards,) = memory_model.stage_shards(cfg, memory_model.pipeline_stages(cfg.model, cfg.parallel))
    real = build_staged_gpt(cfg.model, cfg.parallel)
    frozen = sum(p.numel() for p in real.parameters() if not p.requires_grad)
    assert sum(s.numel for s in shards if not s.trainable) == frozen == 2 * 2 * 256 * 256  # 2 layers' Q and K


# ---------------------------------------------------------------- activations
def _saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of distinct storages autograd keeps for backward after forward and loss (weights excluded)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, (tokens, torch.ones_like(tokens, dtype=torch.float)))  # as training calls it
    return sum(saved.values())


@pytest.mark.parametrize("attention, precision", [("ora", "fp32"), ("ora", "bf16"), ("vanilla", "bf16")])
def test_saved_activations_match_the_formula(one_process, run_config, attention, precision):
    """On CPU, SDPA's flash kernel keeps what the GPU kernels keep (Q, K, V, output, log-sum-exp); dropout
    and norm statistics are CPU-shaped (device="cpu"). Peak transients are not saved tensors: left out."""
    cfg = load_run_config(run_config, [f"model.attention.type={attention}", "model.hidden_dropout=0.1",
                                       *overrides(1, precision)])
    layout = memory_model.layout_of(cfg, world_size=1)
    model = build_staged_gpt(cfg.model, cfg.parallel).to(TORCH_DTYPES[precision]).train()
    tokens = torch.randint(0, 256, (layout.micro_batch_size, cfg.model.seq_length))
    expected = (memory_model.activation_bytes(cfg.model, layout, cfg.model.num_layers, first=True, last=True,
                                              in_flight=1, checkpointing=False, device="cpu")
                - memory_model.logits_transient_bytes(cfg.model, tokens.numel(), layout, device="cpu"))
    assert _saved_bytes(model, tokens) == expected


@pytest.mark.slow
@pytest.mark.gpu  # the activation peak is torch.cuda.max_memory_allocated during a step
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_peak_on_gpu(one_process, checkpointing):
    """bf16, SDPA's GPU kernels: the peak of one forward+backward above the weights and (pre-allocated)
    gradients, against the plan's activations, the loss computed as training does (at TP 1 the fused
    output projection and loss). Tolerance 15%: backward temporaries are not modelled."""
    cfg = load_run_config(str(memory_plan.config_path("small")), ["train.micro_batch_size=8",
                                                                  f"speed.activation_checkpointing={checkpointing}"])
    layout = memory_model.layout_of(cfg, world_size=16)
    model = build_staged_gpt(cfg.model, cfg.parallel).to("cuda", torch.bfloat16).train()
    model.activation_checkpointing = checkpointing
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    tokens = torch.randint(0, cfg.model.vocab_size, (layout.micro_batch_size, cfg.model.seq_length), device="cuda")
    # One step first: the loss's compiled chunk kernel compiles (and autotunes) on its first call.
    model(tokens, (tokens, torch.ones_like(tokens, dtype=torch.float))).backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model(tokens, (tokens, torch.ones_like(tokens, dtype=torch.float))).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    expected = memory_model.activation_bytes(cfg.model, layout, cfg.model.num_layers, first=True, last=True,
                                             in_flight=1, checkpointing=checkpointing)
    assert peak == pytest.approx(expected, rel=0.15)


# ---------------------------------------------------------------- command line
@pytest.mark.slow
def test_verdict_flips_when_the_gpu_shrinks(capsys):
    """As a command, stdout is the JSON alone (DeepSpeed logs a line on import: it goes to stderr)."""
    command = [sys.executable, "-m", "pretrain.research.memory_plan", "--config", "small", "--world-size", "8",
               "--json"]
    roomy = json.loads(subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout)
    assert memory_plan.main(["--config", "small", "--world-size", "8", "--gpu-memory-gb", "1", "--json"]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert (roomy["verdict"], tight["verdict"]) == ("fits", "does not fit")
    assert roomy["bytes"] == tight["bytes"]
    assert roomy["bytes"]["total"] == sum(v for k, v in roomy["bytes"].items() if k != "total")


@pytest.mark.parametrize("flags, key", [
    (["--world-size", "6", "--tp", "4"], "parallel.tensor"),  # 6 GPUs are not a multiple of TP × PP = 4
    (["--world-size", "8", "--pp", "2", "--zero-stage", "3"], "deepspeed.zero_stage"),
])
def test_invalid_layout_exits_2_naming_the_key(capsys, flags, key):
    assert memory_plan.main(["--config", "small", *flags]) == 2
    assert f"'{key}'" in capsys.readouterr().err
