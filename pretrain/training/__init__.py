"""The training loop (trainer) and its evaluation (evaluator), above everything they use: the
runtime's engine, data and metrics, and the checkpointer that saves and resumes them."""
