"""Pretraining: the entry point (pretrain_ora), its config and run dir, and the stages by
subpackage: runtime/ (engine, data, loss, metrics), checkpoint/ (save, resume, reshard,
consolidate), training/ (the loop and evaluation), export/ (Hugging Face), research/ (sweeps,
report, memory plan, benchmarks), launch/ (the launcher)."""
