"""Seeded sweeps: every arm of an experiment spec × every seed, each a run of pretrain.pretrain_ora.

    python -m pretrain.research.sweep --spec pretrain/experiments/core.yaml --out runs/sweeps/core [--scale cpu|paper]
        [--seeds 42,2024,...] [--set key=value ...] [--jobs N] [--retry-failed]
        [--dry-run | --emit commands | --emit slurm]

A spec (pretrain/experiments/*.yaml; a top-level `base: other.yaml` inherits as in run configs):

    config: small                     # the run config: a preset name (pretrain/configs/) or a path
    description: ...                  #   relative to the spec file given on the command line
    reference: vanilla                # the arm the others are compared with (pretrain.research.report)
    seeds: [42, 2024, 12345, 98765, 555666]
    scales:                           # --scale picks one
      cpu: {processes_per_node: 1, set: {model.num_layers: 4, train.steps: 2000, ...}}
      paper: {processes_per_node: 8, set: {}}
    arms:
      vanilla: {description: trainable Q/K/V, set: {model.attention.type: vanilla}}
      wide: {set: {...}, scales: {cpu: {model.hidden_size: 256}, paper: {model.hidden_size: 1024}}}
    evaluations: [attention, probe]   # optional: run on every run after it trains, in this order
    gaps: {arm: ora, reference: vanilla, x: head_dim}   # optional, for the report (below)

Each run is the config with, in this order, the scale's `set`, the arm's `set`, the arm's own
overrides at that scale, the command line's `--set`, then the seed, as `--set key=value` arguments
of the entry point. The seed sets `model.seed` (every weight init, frozen Q/K included, and through
the model build's seeding the dropout RNG) and `data.seed` (megatron-core's shuffling, so
the data order follows the seed too); arms of one seed see the same data in the same order, which
is what makes them paired samples. In the spec's values (not the command line's), `{seed}` in a
string is the run's seed: an arm that starts from another sweep's run of the same seed names it so
(`init_from.path: runs/sweeps/baselines/ora/seed{seed}`). Every expanded config is validated for
its process count before anything starts; an error names the spec, the arm and the key, and the
sweep exits 2.

`gaps` is read by the report (`python -m pretrain.research.report OUT --spec SPEC`), not by the sweep:
the pairs of arms whose difference, paired by seed, is the question, and the quantity the pairs'
shapes vary. Every arm named `<shape>_<arm>` whose twin `<shape>_<reference>` is an arm too is one
shape (heads2_ora and heads2_vanilla: shape heads2); arms of neither form are left out of the gaps.
`x` is one of head_dim (d_k: model.kv_channels, or hidden_size / num_attention_heads), parameters
(the summary's trainable + frozen), seq_length, num_layers, each read from the runs (their config
or summary), so one spec reads alike at every scale. A spec error names the key: an x not in that
list (`gaps.x`), equal suffixes (`gaps.reference`), or no shape with both arms (`gaps`).

Run dirs are OUT/<arm>/seed<seed>, ordered seed-major (all arms of the first seed first, so the
first finished runs already form a paired comparison). Each holds the run's own files, `sweep.log`
(the run's stdout and stderr, appended per attempt), its lock `run.lock` (pretrain.run_files.run_dir: the one
every job in a run dir takes, by which pretrain_ora.py refuses a second job) and `experiment.yaml`
(pretrain.run_files.run_dir.ExperimentRecord: "running" when started, "finished" or "failed" when it ended).
A run's state, read back from them:

    running      its lock is held: a sweep, the run or any other job is alive in it   left alone
    finished     record "finished" (exit 0) and summary.json, or record "running"     skipped
                 and a complete summary (it completed alone after its sweep was gone)
    failed       record "failed" (exit code and log tail recorded)      skipped unless --retry-failed
    interrupted  record "running" or a checkpoint, nobody holds the lock  started again: resumes
    pending      nothing yet                                             started

The sweep takes a run's lock before it records and starts the run, and hands it to the run's
process (pretrain.run_files.lock.RunDirLock: as its stdin), which holds it to its end: a run outlives a
sweep killed with SIGKILL without being started twice, and if it completes alone the next
invocation records it as finished. Two invocations on one sweep dir share its runs: each reads a
run's state again once it holds the lock, and skips a run or evaluation the other finished since
it planned. A restarted run gets the same command; pretrain_ora.py resumes
the run dir from its checkpoint. SIGTERM/SIGINT stop the sweep: no new run starts, running ones
are sent SIGTERM (they checkpoint and exit) and stay "running" in their record, so the next
invocation resumes them. The sweep exits 0 when every run and every evaluation the spec lists is
finished, 1 when some are not, 2 on an invalid spec or config or a run to start without its data,
128 + N on signal N.

Evaluations: `attention` runs `python -m pretrain.research.analyze --run-dir RUN`, `probe` runs
`python -m pretrain.research.probes --run-dir RUN`; each writes RUN/evaluations/<name>.json from the
run's latest checkpoint (downstream tasks read a Hugging Face export, which a sweep does not make:
they are not run by sweeps). A run's evaluations start as its training finishes, one after the
other, holding the run dir's lock and appending to its sweep.log. The file is the result: an
evaluation is finished when its file exists, and otherwise failed when `experiment.yaml`'s
`evaluations` records it so (exit code, log tail; an exit 0 without the file is a failure too),
pending otherwise. A failed evaluation leaves the training finished and does not stop the next one;
a later invocation runs the pending evaluations of finished runs without training them again (and
the failed ones with --retry-failed); an evaluation stopped by SIGTERM/SIGINT stays pending.

`--dry-run` prints, for every run, its state and what this invocation would do with it, decided
by the same code as a real invocation (including the warning about finished runs whose config
changed, and the refusal, status 2, when a run to start has no data), then each of its evaluations'
state and command; it writes nothing.

`--emit commands` prints one shell-quoted entry-point command per run, each followed by its
evaluations' commands. `--emit slurm` writes OUT/sweep.sbatch, an array job whose task i calls this
command with `--task i`: it runs run i through `launch/pretrain_ora.sh CONFIG --set ...` (RUN_DIR,
NNODES, GPUS_PER_NODE in its environment), then its evaluations, with the same records, skips and
locks as a local run.

spec.py reads a spec and expands it into runs, state.py reads each run's and evaluation's state back
and plans an invocation (the dry run's plan too) and writes the records, runner.py starts the
trainings and evaluations and sees them end, slurm.py writes the array job and runs its tasks,
__main__.py is the command.
"""
