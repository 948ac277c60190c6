"""A run's files and records: where each lives in the run dir, its lock, and the typed records
(run_records) that metrics.jsonl, restarts.jsonl and summary.json hold. Imports nothing of pretrain
but pretrain.paths."""
