"""One parallel layout for the whole system: its ranks agree with the groups megatron-core and DeepSpeed
build, so a rank's data-parallel place is the same whichever library is asked."""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core.parallel_state import RankGenerator

from ora_megatron.model_config import ParallelConfig
from pretrain.job.parallel_layout import ParallelLayout


@pytest.mark.parametrize("world_size, tensor, pipeline", [(1, 1, 1), (8, 2, 2), (12, 2, 3), (6, 3, 1), (8, 1, 4)])
def test_ranks_match_deepspeeds_pipeline_grid(world_size, tensor, pipeline):
    layout = ParallelLayout.of(ParallelConfig(tensor=tensor, pipeline=pipeline), world_size)
    grid = PipeModelDataParallelTopology(num_pp=pipeline, num_mp=tensor, num_dp=layout.data)
    for rank in range(world_size):
        coord = grid.get_coord(rank)
        assert (layout.data_rank(rank), layout.tensor_rank(rank), layout.pipeline_rank(rank)) == (
            coord.data, coord.model, coord.pipe)


@pytest.mark.parametrize("world_size, tensor", [(1, 1), (8, 2), (6, 3), (4, 1)])
def test_ranks_match_megatrons_groups(world_size, tensor):
    """megatron-core is initialised with pipeline size 1 here (DeepSpeed runs the pipeline)."""
    layout = ParallelLayout(world_size, tensor)
    groups = RankGenerator(tp=tensor, ep=1, dp=layout.data, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    for data_group in groups.get_ranks("dp"):
        assert len({layout.tensor_rank(r) for r in data_group}) == 1
        assert [layout.data_rank(r) for r in data_group] == list(range(layout.data))
    for tensor_group in groups.get_ranks("tp"):
        assert [layout.tensor_rank(r) for r in tensor_group] == list(range(tensor))


def test_sizes_and_name():
    layout = ParallelLayout(16, tensor=2, pipeline=2)
    assert layout.data == 4 and str(layout) == "DP4/TP2/PP2"
