"""The run config: its sections and their composition (run_config), the sections that come with their
small reader (stability: the skip-step guard; init_from: the import's record), and the reference
docs/config.md generated from it all (docs). Imports the job's room (pretrain.job), the run's files
(pretrain.run_files), pretrain.paths and ora_megatron; the runtime, checkpoints and the loop import it."""
