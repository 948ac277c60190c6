"""Every checkpoint layout the trainer writes consolidates to the single-process model (TP=1, fp32)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu
from pretrain_runs import LAYOUT_WEIGHT_ATOL, LAYOUTS

from ora_megatron.attention import RandomQKVLinear
from ora_megatron.model_config import ParallelConfig
from ora_megatron.parallel import destroy_distributed, init_distributed
from ora_megatron.stages import build_staged_gpt, stage_specs
from pretrain.checkpoint.consolidate import (
    FP32_MASTER,
    MODULE,
    CheckpointMismatch,
    _merge_shards,
    consolidated_state_dict,
    pipeline_layer_file_stage,
)
from pretrain.config.freeze import FreezeStage
from pretrain.config.run_config import read_run_config
from pretrain.run_files.run_dir import RunDir

pytestmark = pytest.mark.distributed

# bf16 forward/backward against the fp32 run: at most a few updates of 1e-3 apart (measured 2.4e-3).
BF16_ATOL = 5e-3

EXTRA_RUNS = {  # name: (overrides, processes). tp2-zero3 on 2 processes would have DP=1, where
    # ZeRO-3 partitions nothing: TP=2 × DP=2 takes 4.
    "tp2dp2-zero3": (["parallel.tensor=2", "deepspeed.zero_stage=3"], 4),
    "bf16-zero1": (["deepspeed.zero_stage=1", "deepspeed.precision=bf16"], 2),
    "bf16-zero3": (["deepspeed.zero_stage=3", "deepspeed.precision=bf16"], 2),
}
FP32_LAYOUTS = [*LAYOUTS, "tp2dp2-zero3"]
BF16_LAYOUTS = ["bf16-zero1", "bf16-zero3"]
Q1 = "layer1.layer.self_attention.linear_qkv.q_weight"


@pytest.fixture(scope="module")
def runs(trained_runs, layout_runs):
    extra = {name: trained_runs.trained(overrides, nproc=nproc) for name, (overrides, nproc) in EXTRA_RUNS.items()}
    return {**layout_runs, **extra}


def latest_checkpoint(run_dir):
    rd = RunDir(run_dir)
    return rd.checkpoint(rd.latest_checkpoint())


def consolidate(run_dir, cfg=None):
    rd = RunDir(run_dir)
    return consolidated_state_dict(cfg or read_run_config(rd), latest_checkpoint(run_dir))


@pytest.fixture(scope="module")
def consolidated(runs):
    """Layout name → its consolidation (computed once per layout)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = consolidate(runs[name])
        return cache[name]

    return get


@pytest.fixture(scope="module")
def reference_state(reference):
    return consolidate(reference).state_dict


def build_tp1_model(run_dir):
    """A TP=1 StagedGPT of the run's config, built in this process like a user's script would."""
    created = not dist.is_initialized()
    init_distributed(1, 1, backend="gloo")
    try:
        return build_staged_gpt(read_run_config(RunDir(run_dir)).model, ParallelConfig())
    finally:
        if created:
            destroy_distributed()


@pytest.fixture(scope="module")
def tp1_model(reference):
    """Never loaded into: its keys, shapes and regenerated frozen Q/K are the expectations."""
    return build_tp1_model(reference)


@pytest.fixture(scope="module")
def regenerated_qk(tp1_model):
    return {f"{prefix}.{role}_weight": getattr(m, f"{role}_weight").detach().clone()
            for prefix, m in tp1_model.named_modules() if isinstance(m, RandomQKVLinear) for role in "qk"}


def assert_tp1_keys_and_fp32(state, tp1_model):
    expected = tp1_model.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        if value is None:  # megatron's _extra_state of local (non-TE) layers
            assert state[key] is None
        else:
            assert state[key].shape == value.shape and state[key].dtype == torch.float32, key


def max_abs_diff(state, other) -> float:
    return max((state[k] - other[k]).abs().max().item() for k in state if state[k] is not None)


@pytest.mark.parametrize("layout", FP32_LAYOUTS)
def test_layout_consolidates_to_the_single_process_weights(consolidated, reference_state, tp1_model, layout):
    result = consolidated(layout)
    assert_tp1_keys_and_fp32(result.state_dict, tp1_model)
    assert max_abs_diff(result.state_dict, reference_state) <= LAYOUT_WEIGHT_ATOL
    uses_masters = "zero0" not in layout and "pp2" not in layout
    assert result.source == (FP32_MASTER if uses_masters else MODULE)


@pytest.mark.parametrize("layout", FP32_LAYOUTS + BF16_LAYOUTS)
def test_frozen_qk_are_the_regenerated_ones(consolidated, regenerated_qk, layout):
    state = consolidated(layout).state_dict
    for name, value in regenerated_qk.items():
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("layout", FP32_LAYOUTS + BF16_LAYOUTS)
def test_loads_strictly_into_a_tp1_model(consolidated, reference, layout):
    state = consolidated(layout).state_dict
    model = build_tp1_model(reference)
    model.load_state_dict(state, strict=True)
    for name, param in model.named_parameters():
        assert torch.equal(param, state[name]), name


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_bf16_returns_the_fp32_master_weights(consolidated, reference_state, tp1_model, runs, layout):
    result = consolidated(layout)
    assert result.source == FP32_MASTER
    assert_tp1_keys_and_fp32(result.state_dict, tp1_model)
    trainable = {n for n, p in tp1_model.named_parameters() if p.requires_grad}
    weights = [result.state_dict[n] for n in trainable]
    assert any((w != w.bfloat16().float()).any() for w in weights), "masters, not the bf16 module copy"
    assert max_abs_diff(result.state_dict, reference_state) <= BF16_ATOL
    if layout == "bf16-zero1":  # the saved bf16 module is the masters rounded: same state, same step
        assert result.saved_dtype == torch.bfloat16
        module = torch.load(latest_checkpoint(runs[layout]) / "mp_rank_00_model_states.pt",
                            weights_only=False)["module"]
        for name in trainable:
            assert torch.equal(result.state_dict[name].bfloat16(), module[name]), name
    else:  # ZeRO-3 saves placeholders for the module
        assert result.saved_dtype is None


def test_pipeline_layer_files_name_their_stages(runs, reference):
    checkpoint = latest_checkpoint(runs["pp2-zero1"])
    cfg = read_run_config(RunDir(runs["pp2-zero1"]))
    found = {p.name: pipeline_layer_file_stage(p, stage_specs(cfg.model, cfg.parallel))
             for p in checkpoint.glob("layer_*")}
    assert found == {  # the tied gpt2 output stage (index 4) has no file of its own
        "layer_00-model_00-model_states.pt": ("embedding", 0),
        "layer_01-model_00-model_states.pt": ("layer1", 0),
        "layer_02-model_00-model_states.pt": ("layer2", 0),
        "layer_03-model_00-model_states.pt": ("final_norm", 0),
    }


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "layer_1-model_00-model_states.pt",
                                  "layer_05-model_00-model_states.pt", "layer_01-model_states.pt",
                                  "layer_01-model_00-model_states.pt.tmp"])
def test_unknown_pipeline_file_names_are_rejected(reference, name):
    cfg = read_run_config(RunDir(reference))
    with pytest.raises(ValueError, match=re.escape(name)):
        pipeline_layer_file_stage(f"/ckpt/step00000006/{name}", stage_specs(cfg.model, cfg.parallel))


# layout → (file of the latest checkpoint, path within it to a stored copy of layer 1's frozen Q)
STORED_Q = {
    "dp2-zero1": ("mp_rank_00_model_states.pt", ("module", Q1)),
    "tp2-zero1": ("mp_rank_01_model_states.pt", ("module", Q1)),
    "pp2-zero1": ("layer_01-model_00-model_states.pt", ("layer.self_attention.linear_qkv.q_weight",)),
    "dp2-zero3": ("zero_pp_rank_0_mp_rank_00_model_states.pt", ("frozen_param_fragments", Q1)),
}


def tampered_copy(run_dir, layout, destination):
    """A copy of the run's config and checkpoints with one element of a stored frozen Q changed."""
    source, copy = RunDir(run_dir), RunDir(destination)
    shutil.copytree(source.checkpoints, copy.checkpoints)
    shutil.copy(source.config, copy.config)
    file_name, path = STORED_Q[layout]
    file = latest_checkpoint(destination) / file_name
    data = torch.load(file, weights_only=False)
    tensor = data
    for key in path:
        tensor = tensor[key]
    tensor.view(-1)[0] += 1e-3
    torch.save(data, file)
    return destination


@pytest.mark.parametrize("layout", STORED_Q)
def test_tampered_frozen_q_is_rejected(runs, tmp_path, layout):
    tampered = tampered_copy(runs[layout], layout, tmp_path / layout)
    with pytest.raises(CheckpointMismatch, match="layer1.*q_weight.*different seed or attention config"):
        consolidate(tampered)


def test_trained_q_is_taken_from_the_checkpoint(runs, tmp_path):
    """A Q that was trainable in some step is an ordinary weight: the stored value, unchecked."""
    tampered = tampered_copy(runs["dp2-zero1"], "dp2-zero1", tmp_path / "run")
    stored = torch.load(latest_checkpoint(tampered) / "mp_rank_00_model_states.pt", weights_only=False)["module"][Q1]
    cfg = read_run_config(RunDir(tampered))
    cfg.model.attention.train_q = True
    assert torch.equal(consolidate(tampered, cfg).state_dict[Q1], stored)

    cfg = read_run_config(RunDir(tampered))  # layer 1's Q trainable from step 3 of 6 on
    cfg.freeze.schedule = [FreezeStage(0.0, "all", "all"), FreezeStage(0.5, [2], "all")]
    assert torch.equal(consolidate(tampered, cfg).state_dict[Q1], stored)
    cfg.freeze.schedule = [FreezeStage(0.0, "all", "all"), FreezeStage(0.9, [2], "all")]  # not reached
    with pytest.raises(CheckpointMismatch):
        consolidate(tampered, cfg)


def test_consolidation_leaves_the_process_group_as_it_found_it(reference):
    before = dist.is_initialized()
    consolidate(reference)
    assert dist.is_initialized() == before


def test_strided_shards_merge_back_to_the_master_weight():
    """SwiGLU's fc1 (partition_stride 2): each TP rank holds its slice of the gate and of the up
    projection; merging must undo megatron's strided split, not just concatenate."""
    master = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    shards = [torch.nn.Parameter(torch.empty(4, 3)) for _ in range(2)]
    for rank, shard in enumerate(shards):  # also sets the partition attributes the merge reads
        _initialize_affine_weight_cpu(shard, 8, 3, 4, 0, lambda w: w.copy_(master), stride=2,
                                      rank=rank, world_size=2)
    assert not torch.equal(torch.cat([s.detach() for s in shards]), master)
    assert torch.equal(_merge_shards("fc1", [s.detach() for s in shards], shards[0]), master)
