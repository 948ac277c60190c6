"""Exit statuses of the training entry and of every worker: what a job's supervisor and a scheduler read.

A supervised job (pretrain/launch/supervisor.py) never retries a status in FINAL: each is the run's own decision.
"""

EXIT_CONFIG_ERROR = 2  # refused before training: the message names the key, file or flag
EXIT_TRAINING_STOPPED = 3  # the run stopped itself: skipped steps or rewinds used up, a checkpoint save failed
EXIT_HUNG = 4  # a rank's hang watchdog fired (supervision.hang_timeout_s): its stacks are in the run dir's hangs/
EXIT_WALL_TIME = 75  # stopped with a checkpoint at supervision.max_wall_time: the same command resumes (a requeue)

FINAL = {EXIT_CONFIG_ERROR: "refused", EXIT_TRAINING_STOPPED: "the run stopped itself",
         EXIT_WALL_TIME: "stopped at supervision.max_wall_time"}
STATUS_NAMES = {**FINAL, EXIT_HUNG: "hung", 1: "error"}
