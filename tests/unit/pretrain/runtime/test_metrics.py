"""MetricsLogger: which steps are logged, what a record holds, where it goes (metrics.jsonl, the
progress bar, TensorBoard and wandb when enabled; nothing off rank 0); throughput over a window of
steps; IterationTimer's pauses and windows."""

from __future__ import annotations

import math
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from one_process import tiny_run

from pretrain.config.loop_sections import TrainConfig
from pretrain.config.runtime_sections import LoggingConfig
from pretrain.run_files.run_dir import RunDir
from pretrain.run_files.run_records import EvalRecord, TrainRecord
from pretrain.runtime import metrics
from pretrain.runtime.accounting import flops_per_token
from pretrain.runtime.metrics import IterationTimer, MetricsLogger, Throughput, throughput, wandb_run_id

TOKENS_PER_STEP = 8 * 16  # global batch × model_fixtures' sequence length
PEAK_MEM = 12345


@pytest.fixture(autouse=True)
def on_rank(monkeypatch):
    """Run the logger as rank `rank` of `world_size` (rank 0 of 1 unless a test says otherwise)."""
    def as_rank(rank: int, world_size: int = 1) -> None:
        monkeypatch.setattr(metrics, "dist", SimpleNamespace(get_rank=lambda: rank, get_world_size=lambda: world_size))

    monkeypatch.setattr(metrics, "peak_memory_bytes", lambda: PEAK_MEM)
    as_rank(0)
    return as_rank


@pytest.fixture
def run_dir(tmp_path) -> RunDir:
    """The run's folder, as the entry point creates it before training starts."""
    (tmp_path / "run").mkdir()
    return RunDir(tmp_path / "run")


def config(logging: LoggingConfig | None = None):
    """20 steps of 8 samples, logged every 5; by default metrics.jsonl only (no TensorBoard, wandb or bar)."""
    return tiny_run(train=TrainConfig(micro_batch_size=2, global_batch_size=8, steps=20, log_interval=5),
                    logging=logging or LoggingConfig(tensorboard=False, wandb_mode="disabled", progress=False))


def logger(run_dir: RunDir, cfg=None, start_step: int = 0) -> MetricsLogger:
    return MetricsLogger(run_dir, cfg or config(), {"model": "tiny"}, start_step=start_step)


def log_step(logger: MetricsLogger, step: int, *, loss: float = 2.5, skipped: bool = False,
             grad_norm: float | None = 0.75, seconds: float = 0.5, window_steps: int = 1) -> None:
    logger.train_step(step, loss, seconds, window_steps=window_steps, skipped=skipped, skipped_steps=1, lr=1e-3,
                      grad_norm=grad_norm, trainable_params=1000)


# ---------------------------------------------------------------------------- when a step is logged
def test_due_every_log_interval_and_at_every_skipped_step(run_dir):
    log = logger(run_dir)
    assert [step for step in range(1, 13) if log.due(step, skipped=False)] == [5, 10]
    assert log.due(3, skipped=True)


def test_only_due_steps_are_written(run_dir):
    log = logger(run_dir)
    for step in (3, 4, 5):
        log_step(log, step)
    log_step(log, 7, skipped=True)
    assert [(r.step, r.split) for r in run_dir.read_records()] == [(5, "train"), (7, "train")]


# ---------------------------------------------------------------------------- what a record holds
def test_train_record_fields(run_dir):
    """tokens/s from the step's own time; no TFLOP/s or MFU where the device's peak is unknown (CPU)."""
    log_step(logger(run_dir), 5)
    assert run_dir.read_records() == [TrainRecord(
        step=5, loss=2.5, lr=1e-3, grad_norm=0.75, tokens_per_s=TOKENS_PER_STEP / 0.5, step_time_s=0.5,
        skipped_steps=1, trainable_params=1000, peak_mem_bytes=PEAK_MEM, tflops_per_device=None, mfu=None)]


def test_mfu_with_a_known_device_peak(run_dir, monkeypatch, on_rank):
    """Against the peak of the run's precision; over the window of steps since the previous record."""
    on_rank(0, world_size=4)
    asked = []
    monkeypatch.setattr(metrics, "device_peak_tflops", lambda precision: asked.append(precision) or 100.0)
    cfg = config()
    log_step(logger(run_dir, cfg), 5, seconds=2.0, window_steps=4)
    record, = run_dir.read_records()
    assert asked == [cfg.deepspeed.precision]
    assert (record.step_time_s, record.tokens_per_s) == (0.5, TOKENS_PER_STEP / 0.5)
    per_device = flops_per_token(cfg.model) * (TOKENS_PER_STEP / 0.5) / 4 / 1e12
    assert record.tflops_per_device == pytest.approx(per_device, rel=1e-12)
    assert record.mfu == pytest.approx(per_device / 100.0, rel=1e-12)


def test_throughput_over_a_window():
    """4 steps of 8,192 tokens in 2 s on 2 ranks, 6 GFLOP per token: 0.5 s a step, 16,384 tokens/s,
    49.152 TFLOP/s per device, MFU 49.152 / 989.5; no TFLOP/s or MFU without a peak."""
    speed = throughput(2.0, 4, 8192, 6e9, 2, 989.5)
    assert speed.step_time_s == 0.5 and speed.tokens_per_s == 16384.0
    assert speed.tflops_per_device == pytest.approx(49.152, rel=1e-12)
    assert speed.mfu == pytest.approx(49.152 / 989.5, rel=1e-12)
    assert throughput(2.0, 4, 8192, 6e9, 2, None) == Throughput(0.5, 16384.0, None, None)


@pytest.mark.parametrize("loss, ppl", [(2.0, math.exp(2.0)), (80.0, math.exp(50.0))], ids=["exp", "capped"])
def test_evaluation_record(run_dir, loss, ppl):
    logger(run_dir).evaluation(6, "valid", loss)
    assert run_dir.read_records() == [EvalRecord(step=6, split="valid", loss=loss, ppl=ppl)]


# ---------------------------------------------------------------------------- the progress bar
def test_progress_bar_moves_every_step_and_shows_the_last_logged_loss(run_dir, capsys):
    """A resumed run's bar starts at its step; every step moves it, logged or not."""
    log = logger(run_dir, config(LoggingConfig(tensorboard=False, wandb_mode="disabled")), start_step=2)
    assert (log.bar.n, log.bar.total) == (2, 20)
    log.step_done(3)
    assert log.bar.n == 3
    log_step(log, 5)
    log.step_done(5)
    assert log.bar.n == 5
    # The run's fault counters join the bar once they are not zero (here the 1 skipped step log_step reports).
    assert log.bar.postfix == f"loss=2.5000, lr=1.00e-03, skipped=1, tok_s={TOKENS_PER_STEP / 0.5:,.0f}"
    log.train_step(10, 2.5, 0.5, skipped=False, skipped_steps=1, lr=1e-3, grad_norm=0.75, trainable_params=1000,
                   spike_skips=2, restarts=3, hangs=1, rewinds=1)
    assert log.bar.postfix == (f"hangs=1, loss=2.5000, lr=1.00e-03, restarts=3, rewinds=1, skipped=3, "
                               f"tok_s={TOKENS_PER_STEP / 0.5:,.0f}")
    log.close()
    assert "5/20" in capsys.readouterr().err


def test_events_and_fault_counters_are_recorded(run_dir):
    """A restart, rewind or skipped spike is an event line of metrics.jsonl; the train records carry
    the run's counters, which TensorBoard and wandb get as scalars."""
    log = logger(run_dir)
    log.event(4, "rewind", {"checkpoint": "step00000002", "skipped_batches": [3, 5]})
    log.train_step(5, 2.5, 0.5, skipped=True, skipped_steps=0, lr=1e-3, grad_norm=9.0, trainable_params=1000,
                   skip_reason="loss spike", spike_skips=1, restarts=2, hangs=1, rewinds=1)
    log.close()
    event, train = run_dir.read_records()
    assert (event.split, event.step, event.kind, event.detail["skipped_batches"]) == ("event", 4, "rewind", [3, 5])
    assert (train.skip_reason, train.spike_skips, train.restarts, train.hangs, train.rewinds) == (
        "loss spike", 1, 2, 1, 1)
    assert run_dir.read_records("event") == [event]


# ---------------------------------------------------------------------------- sinks
@pytest.fixture
def fake_sinks(monkeypatch):
    """torch.utils.tensorboard and wandb replaced by recorders of what the logger asks of them."""
    calls = []

    class SummaryWriter:
        def __init__(self, **kwargs):
            calls.append(("tb", kwargs))

        def add_scalar(self, *args):
            calls.append(("tb", *args))

        def close(self):
            calls.append(("tb closed",))

    class WandbRun:
        def log(self, values, step):
            calls.append(("wandb", values, step))

        def finish(self):
            calls.append(("wandb finished",))

    def init(**kwargs):
        calls.append(("wandb", kwargs))
        return WandbRun()

    tensorboard, wandb = ModuleType("torch.utils.tensorboard"), ModuleType("wandb")
    tensorboard.SummaryWriter, wandb.init = SummaryWriter, init
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tensorboard)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    return calls


def test_tensorboard_and_wandb_get_every_finite_number_of_a_record(run_dir, fake_sinks):
    cfg = config(LoggingConfig(tensorboard=True, wandb_mode="offline", wandb_project="tiny", progress=False))
    log = logger(run_dir, cfg)
    log_step(log, 5, loss=float("nan"), grad_norm=None)  # neither is a number to plot
    log.evaluation(5, "valid", 2.0)
    log.close()

    train = {"lr": 1e-3, "tokens_per_s": TOKENS_PER_STEP / 0.5, "step_time_s": 0.5, "skipped_steps": 1,
             "trainable_params": 1000, "peak_mem_bytes": PEAK_MEM, "spike_skips": 0, "restarts": 0, "hangs": 0,
             "rewinds": 0}
    valid = {"loss": 2.0, "ppl": math.exp(2.0)}
    assert fake_sinks == [
        ("tb", {"log_dir": str(run_dir.tensorboard)}),
        ("wandb", {"project": "tiny", "mode": "offline", "dir": str(run_dir.path), "config": {"model": "tiny"},
                   "resume": "allow", "id": wandb_run_id(run_dir, cfg), "name": "run"}),
        *[("tb", f"train/{key}", value, 5) for key, value in train.items()],
        ("wandb", {f"train/{key}": value for key, value in train.items()}, 5),
        *[("tb", f"valid/{key}", value, 5) for key, value in valid.items()],
        ("wandb", {f"valid/{key}": value for key, value in valid.items()}, 5),
        ("tb closed",), ("wandb finished",),
    ]


def test_layer_grad_norms_are_kept_in_the_record_and_plotted_per_stage(run_dir, fake_sinks):
    log = logger(run_dir, config(LoggingConfig(tensorboard=True, wandb_mode="disabled", progress=False)))
    norms = {"embedding": 0.5, "layer1": 0.25, "layer2": None}  # None: not finite on that step
    log.train_step(5, 2.5, 0.5, skipped=False, skipped_steps=0, lr=1e-3, grad_norm=0.75, trainable_params=1000,
                   layer_grad_norms=norms)
    log.close()
    assert run_dir.read_records()[0].layer_grad_norms == norms
    plotted = {call[1]: call[2] for call in fake_sinks if call[0] == "tb" and len(call) == 4}
    assert plotted["train/layer_grad_norms/embedding"] == 0.5 and plotted["train/layer_grad_norms/layer1"] == 0.25
    assert "train/layer_grad_norms/layer2" not in plotted


def test_tensorboard_and_wandb_off_write_only_metrics(run_dir, fake_sinks):
    log = logger(run_dir)
    log_step(log, 5)
    log.close()
    assert (log.tb, log.wandb, log.bar) == (None, None, None) and fake_sinks == []
    assert [p.name for p in run_dir.path.iterdir()] == ["metrics.jsonl"]


def test_other_ranks_write_nothing(run_dir, fake_sinks, on_rank, capsys):
    on_rank(1, world_size=2)
    log = logger(run_dir, config(LoggingConfig(tensorboard=True, wandb_mode="offline", progress=True)))
    assert log.due(5, skipped=False)  # the same rule as rank 0's: the loop's collective needs every rank
    log_step(log, 5)
    log.step_done(5)
    log.evaluation(5, "valid", 2.0)
    log.close()
    assert list(run_dir.path.iterdir()) == [] and fake_sinks == [] and capsys.readouterr().err == ""


def test_wandb_run_id_is_kept_in_the_run_dir(run_dir, tmp_path):
    """Made once and reused by every resume, changed config included; another run dir gets another."""
    run_id = wandb_run_id(run_dir, config())
    assert len(run_id) == 16 and (run_dir.path / "wandb" / "run_id").read_text() == run_id + "\n"
    assert wandb_run_id(run_dir, tiny_run("vanilla")) == run_id
    assert wandb_run_id(RunDir(tmp_path / "other"), config()) != run_id


# ---------------------------------------------------------------------------- IterationTimer
class Clock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_iteration_timer_leaves_pauses_out_of_the_lap(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics, "time", clock)
    timer = IterationTimer()
    clock.now = 101.0
    assert timer.lap() == 1.0
    clock.now = 102.0
    with timer.paused():  # an evaluation
        clock.now = 104.5
    with pytest.raises(KeyError), timer.paused():  # a pause that raises counts too
        clock.now = 105.0
        raise KeyError
    clock.now = 106.0
    assert timer.lap() == 106.0 - 101.0 - 3.0
    clock.now = 107.5
    assert timer.lap() == 1.5  # pauses belong to the lap they fell in


@pytest.mark.parametrize("cuda", [False, True])
def test_iteration_timer_window_waits_for_the_device_once(monkeypatch, cuda):
    """A window holds its laps and the time after the last one, pauses excluded; where this process
    uses CUDA it waits for the device first, once, and that wait is the window's too."""
    clock, synced = Clock(), []

    def synchronize():
        synced.append(clock.now)
        clock.now += 0.75  # the queued kernels finish

    monkeypatch.setattr(metrics, "time", clock)
    monkeypatch.setattr(metrics.torch.cuda, "is_initialized", lambda: cuda)
    monkeypatch.setattr(metrics.torch.cuda, "synchronize", synchronize)
    timer = IterationTimer()
    for _ in range(3):
        clock.now += 0.25
        timer.lap()
    with timer.paused():  # an evaluation
        clock.now += 5.0
    clock.now += 0.5  # the logged step's loss reduction
    wait = 0.75 if cuda else 0.0
    assert timer.window() == (0.75 + 0.5 + wait, 3)
    assert synced == ([clock.now - 0.75] if cuda else [])
    clock.now += 1.0
    assert timer.lap() == 1.0 and timer.window() == (1.0 + wait, 1)  # the next window starts where this one ended


@pytest.mark.gpu
def test_window_on_a_gpu_holds_the_device_time():
    """Laps see the launch of the queued kernels; the window, after its synchronisation, their run too."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timer = IterationTimer()
    start.record()
    for _ in range(3):
        for _ in range(20):
            a = a @ a / 64.0
        timer.lap()
    end.record()
    seconds, steps = timer.window()
    assert steps == 3 and seconds >= start.elapsed_time(end) / 1e3
