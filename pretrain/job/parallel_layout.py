"""How a job's processes split into data, tensor and pipeline parallelism, and where each rank sits.

One object for every part of the system that needs a size or a rank of the layout (the config's checks
before launch, the data order, the engine, checkpoints and their conversion, the memory model), instead
of each asking megatron-core's parallel state or DeepSpeed's pipeline grid on its own.

Ranks run tensor-fastest, then data, then pipeline: the order megatron-core builds its groups in
(tensor, then data, at pipeline size 1, the only one it is initialised with here) and the order of
DeepSpeed's PipeModelDataParallelTopology (pipe, data, model axes, the last fastest), so both libraries'
groups agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ora_megatron.model_config import ParallelConfig


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    tensor: int = 1
    pipeline: int = 1

    @classmethod
    def of(cls, parallel: ParallelConfig, world_size: int) -> ParallelLayout:
        return cls(world_size, parallel.tensor, parallel.pipeline)

    @property
    def data(self) -> int:
        """The data-parallel size: the world size over tensor × pipeline."""
        return self.world_size // (self.tensor * self.pipeline)

    def tensor_rank(self, rank: int) -> int:
        return rank % self.tensor

    def data_rank(self, rank: int) -> int:
        return rank // self.tensor % self.data

    def pipeline_rank(self, rank: int) -> int:
        return rank // (self.tensor * self.data)

    def to_json(self) -> dict:
        """The sizes as records hold them, the data-parallel size spelt out for a reader."""
        return {"world_size": self.world_size, "data": self.data, "tensor": self.tensor, "pipeline": self.pipeline}

    @classmethod
    def from_json(cls, record: dict) -> ParallelLayout:
        return cls(record["world_size"], record["tensor"], record["pipeline"])

    def __str__(self) -> str:
        return f"DP{self.data}/TP{self.tensor}/PP{self.pipeline}"
