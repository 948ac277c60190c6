"""The training runtime: the DeepSpeed engine around the model (engine), its loss and optimizer,
data, metrics, freeze schedules, accounting, and every use of DeepSpeed's optimizer internals
(ds_internals). The loop that drives them is pretrain/training/."""
