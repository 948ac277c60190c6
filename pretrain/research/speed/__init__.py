"""A GPU step-time model from a CPU: the ops one training step dispatches on CUDA (`trace`), each
costed by a roofline with a few constants per GPU kind fitted to the committed GPU measurements
(`gpus`, `cost`, `fit`), and the step time per micro-batch and optimizer step that the cluster plan
reads (`step_time`). docs/speed_model.md describes it and holds it against every measured step."""
