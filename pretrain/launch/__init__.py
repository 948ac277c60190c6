"""A job's start and its supervision, from the process that launches the ranks: the start resolved
once before any worker trains (start), the supervisor that watches, kills and restarts the ranks
(supervisor), the entry's own torchrun spawn (local), the launch variables turned into DeepSpeed's
launcher command (launcher, behind launch/pretrain_ora.sh) and DeepSpeed hostfiles (hostfile). It may
import every room below it (the training loop too); no rank's code imports it."""
