"""The run config: its composition (run_config), the sections read by rooms above it, one module per
reader (runtime_sections, loop_sections, freeze, stability, init_from), and the reference
docs/config.md generated from them (docs). Imports the job's room (pretrain.job), the run's files
(pretrain.run_files), pretrain.paths and ora_megatron, and never torch: a config loads before any
worker starts. The runtime, checkpoints, the loop and the launch import it."""
