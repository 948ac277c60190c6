"""Checkpoints: when and how a run saves and resumes (checkpointer), what a resume may change
(resume_check), resuming on another topology (reshard), one state dict from any checkpoint (consolidate)."""
