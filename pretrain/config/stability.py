"""The run config's `stability:` section: what a run does about steps it cannot apply (skip-step of
spikes, the rewind of a divergence that persists, and how many skipped steps in a row make one). Its
readers: the step guard (pretrain/runtime/step_guard.py, which holds the skip-step rule) and the
training loop's skip and rewind handling (pretrain/training/trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ora_megatron.config_io import check


@dataclass
class SpikeSkip:
    """Skip-step (OLMo-core's SkipStepOptimizer rule): an update whose loss or gradient norm lies above
    the mean + sigma × the standard deviation of the last `window` steps' is not applied."""

    enabled: bool = False
    """Skip updates whose loss or gradient norm spikes; costs one scalar all-reduce per step."""
    window: int = 128
    """Steps whose loss and gradient norm make the statistics; decisions start once half of it is filled."""
    sigma: float = 6.0
    """An update is skipped above mean + sigma × std of the window (loss or gradient norm)."""

    def validate(self, key: str) -> None:
        check(self.window >= 4, f"{key}.window", "must be >= 4")
        check(self.sigma > 0, f"{key}.sigma", "must be > 0")


@dataclass
class Rewind:
    """What a divergence that persists does (stability.max_consecutive_skips skipped steps in a row):
    reload the newest checkpoint from before it and skip the data batches that led to it (PaLM's
    recipe: back ~100 steps before a spike, 200-500 batches skipped), instead of stopping the run."""

    enabled: bool = False
    """Rewind instead of stopping when stability.max_consecutive_skips steps in a row were skipped."""
    skip_batches: int = 200
    """Global batches skipped: those that end with the divergent steps' (all of them at least); the steps before
    them, from the checkpoint on, train again on their own batches."""
    max_rewinds: int = 3
    """Rewinds in the whole run; one more divergence stops it (status 3, summary.json says why)."""

    def validate(self, key: str) -> None:
        check(self.skip_batches >= 1, f"{key}.skip_batches", "must be >= 1")
        check(self.max_rewinds >= 1, f"{key}.max_rewinds", "must be >= 1")


@dataclass
class StabilityConfig:
    """What the run does about steps it cannot apply: non-finite ones, spikes, and runs of them."""

    max_consecutive_skips: int = 5
    """Steps with a non-finite loss (or a spike, with spike_skip) are skipped; this many in a row stops the
    run, or rewinds it (rewind)."""
    spike_skip: SpikeSkip = field(default_factory=SpikeSkip)
    """Loss-spike skip-step."""
    rewind: Rewind = field(default_factory=Rewind)
    """Rewind a divergence that persists."""

    def validate(self, key: str) -> None:
        check(self.max_consecutive_skips > 0, f"{key}.max_consecutive_skips", "must be > 0")
        self.spike_skip.validate(f"{key}.spike_skip")
        self.rewind.validate(f"{key}.rewind")
