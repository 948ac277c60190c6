"""The training runtime: the loop (trainer), the DeepSpeed engine around the model (engine), its loss
and optimizer, data, evaluation, metrics, freeze schedules, accounting, and every use of DeepSpeed
internals (ds_internals)."""
