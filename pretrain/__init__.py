"""Pretraining: the entry point (pretrain_ora), its config and run dir, and the stages by
subpackage: runtime/ (training), checkpoint/ (save, resume, reshard, consolidate), export/
(Hugging Face), research/ (sweeps, report, memory plan, benchmarks), launch/ (the launcher)."""

from ora_megatron.module_aliases import install

# Commands users may have scripted, from before the modules were grouped by stage, and short names.
install({
    "pretrain.convert_to_hf": "pretrain.export.convert_to_hf",
    "pretrain.generate": "pretrain.export.generate",
    "pretrain.evaluate": "pretrain.export.evaluate",
    "pretrain.sweep": "pretrain.research.sweep",
    "pretrain.report": "pretrain.research.report",
    "pretrain.plan": "pretrain.research.memory_plan",
    "pretrain.bench": "pretrain.research.benchmarks.compare_arms",
    "pretrain.hostfile": "pretrain.launch.hostfile",
    "pretrain.analyze": "pretrain.research.analyze",
})
