"""What a rank knows of its job: the attempt it belongs to, the job's restarts and stop signals, the
`supervision:` section (supervision), the exit statuses a supervisor reads (exit_status), how the
processes split into parallel groups (parallel_layout), the process environment (environment), the
faults made on purpose (faults) and which extras a command needs (extras). Every rank imports this
room; it imports only the run's files (pretrain.run_files), pretrain.paths and ora_megatron, never the
supervisor (pretrain/launch/supervisor.py)."""
