"""The training runtime: the loop (trainer), the DeepSpeed engine around the model, data, evaluation,
metrics, freeze schedules, accounting, and every use of DeepSpeed internals (ds_internals)."""
