"""The LR schedule's added decay styles (cosine_restarts, polynomial): their closed forms, torch's and
transformers' own schedules, megatron's styles unchanged (its WSD too), a bitwise resume mid-cycle,
config errors naming the key, and the presets' plotted schedules."""

from __future__ import annotations

import json
import math

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from transformers import get_polynomial_decay_schedule_with_warmup

from ora_megatron.config_io import ConfigError, from_dict
from pretrain.config.run_config import RunConfig, load_run_config
from pretrain.paths import preset_path
from pretrain.research import lr_schedule_plot
from pretrain.runtime.optimizer import lr_scheduler

LR, MIN_RATIO, WARMUP, STEPS, CYCLE = 1e-3, 0.1, 10, 100, 30
MIN_LR = LR * MIN_RATIO


def run_config(**optimizer) -> RunConfig:
    opt = {"lr": LR, "min_lr_ratio": MIN_RATIO, "warmup_steps": WARMUP, **optimizer}
    return from_dict(RunConfig, {"train": {"steps": STEPS}, "optimizer": opt})


RESTARTS = {"decay_style": "cosine_restarts", "restart_cycle_steps": CYCLE, "restart_peak_decay": 0.5}
POLYNOMIAL = {"decay_style": "polynomial", "decay_power": 2.0}
WSD_DECAY = 20
WSD = {"decay_style": "wsd", "wsd_decay_steps": WSD_DECAY, "wsd_decay_style": "cosine"}


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=LR)


def lrs(cfg: RunConfig, last: int) -> list[float]:
    """The LR the run's scheduler sets at steps 0..last (the trainer steps it by 1 before each update)."""
    opt = optimizer()
    scheduler = lr_scheduler(cfg, opt)
    values = [opt.param_groups[0]["lr"]]
    for _ in range(last):
        scheduler.step(1)
        values.append(opt.param_groups[0]["lr"])
    return values


def cosine(peak: float, position: int) -> float:
    return MIN_LR + (peak - MIN_LR) * 0.5 * (1 + math.cos(math.pi * position / CYCLE))


def test_cosine_restarts_closed_form():
    lr = lrs(run_config(**RESTARTS), STEPS + 20)
    assert lr[WARMUP // 2] == pytest.approx(LR / 2, rel=1e-12)  # megatron's warmup
    assert lr[WARMUP] == LR
    assert lr[WARMUP + 15] == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)  # mid-cycle: halfway down
    assert lr[WARMUP + 29] == pytest.approx(cosine(LR, 29), rel=1e-12)
    assert lr[WARMUP + 30] == pytest.approx(LR * 0.5, rel=1e-12)  # cycle boundary: restart at the decayed peak
    assert lr[WARMUP + 37] == pytest.approx(cosine(LR * 0.5, 7), rel=1e-12)
    assert lr[WARMUP + 60] == pytest.approx(LR * 0.25, rel=1e-12)
    assert lr[WARMUP + 89] == pytest.approx(cosine(LR * 0.25, 29), rel=1e-12)
    assert lr[STEPS:] == [MIN_LR] * 21  # from the decay steps on, where a fourth cycle would have restarted
    # Peaks never fall below the minimum: a long decay holds the minimum.
    many_cycles = lrs(run_config(**{**RESTARTS, "restart_cycle_steps": 2, "restart_peak_decay": 0.01}), STEPS)
    assert many_cycles[WARMUP + 4:STEPS] == [MIN_LR] * (STEPS - WARMUP - 4)


def test_cosine_restarts_equals_torch_warm_restarts():
    """Without peak decay: torch's CosineAnnealingWarmRestarts (T_0 = the cycle, T_mult 1) after warmup."""
    ours = lrs(run_config(**{**RESTARTS, "restart_peak_decay": 1.0}), STEPS - 1)
    opt = optimizer()
    torch_schedule = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=CYCLE, eta_min=MIN_LR)
    theirs = []
    for _ in range(WARMUP, STEPS):
        theirs.append(opt.param_groups[0]["lr"])
        torch_schedule.step()
    assert ours[WARMUP:] == pytest.approx(theirs, rel=1e-12)
    assert max(ours[WARMUP + 1:]) == ours[WARMUP + CYCLE] == pytest.approx(LR, rel=1e-12)  # restarts


def test_polynomial_closed_form_and_transformers():
    lr = lrs(run_config(**POLYNOMIAL), STEPS + 20)
    span = STEPS - WARMUP
    assert lr[WARMUP] == LR
    for step in (WARMUP + 1, WARMUP + span // 3, WARMUP + span // 2, STEPS - 1):
        assert lr[step] == pytest.approx((LR - MIN_LR) * (1 - (step - WARMUP) / span) ** 2 + MIN_LR, rel=1e-12)
    assert lr[STEPS:] == [MIN_LR] * 21
    opt = optimizer()
    hf = get_polynomial_decay_schedule_with_warmup(opt, WARMUP, STEPS, lr_end=MIN_LR, power=2.0)
    theirs = []
    for _ in range(STEPS + 21):
        theirs.append(opt.param_groups[0]["lr"])
        hf.step()
    assert lr == pytest.approx(theirs, rel=1e-12)
    # Power 1 is the linear decay.
    assert lrs(run_config(decay_style="polynomial"), STEPS) == pytest.approx(lrs(run_config(decay_style="linear"),
                                                                                 STEPS), rel=1e-12)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_megatron_styles_unchanged(style):
    cfg = run_config(decay_style=style)
    opt = optimizer()
    megatron = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_steps=STEPS,
        lr_decay_style=style, start_wd=0.01, end_wd=0.01, wd_incr_steps=STEPS, wd_incr_style="constant")
    theirs = [opt.param_groups[0]["lr"]]
    for _ in range(STEPS + 5):
        megatron.step(1)
        theirs.append(opt.param_groups[0]["lr"])
    assert lrs(cfg, STEPS + 5) == theirs


@pytest.mark.parametrize("style", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_wsd_is_megatrons(style):
    """Warmup, lr until the last wsd_decay_steps, then megatron's decay shape to the minimum, kept after."""
    lr = lrs(run_config(**{**WSD, "wsd_decay_style": style}), STEPS + 5)
    opt = optimizer()
    megatron = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_steps=STEPS,
        lr_decay_style="WSD", start_wd=0.01, end_wd=0.01, wd_incr_steps=STEPS, wd_incr_style="constant",
        wsd_decay_steps=WSD_DECAY, lr_wsd_decay_style=style)
    theirs = [opt.param_groups[0]["lr"]]
    for _ in range(STEPS + 5):
        megatron.step(1)
        theirs.append(opt.param_groups[0]["lr"])
    assert lr == theirs
    assert lr[WARMUP:STEPS - WSD_DECAY + 1] == [LR] * (STEPS - WSD_DECAY - WARMUP + 1)  # stable
    assert lr[STEPS] == pytest.approx(MIN_LR, rel=1e-12) and lr[STEPS + 1:] == [MIN_LR] * 5
    assert all(a > b for a, b in zip(lr[STEPS - WSD_DECAY:STEPS], lr[STEPS - WSD_DECAY + 1:STEPS + 1]))


@pytest.mark.parametrize("schedule, stop", [(RESTARTS, WARMUP + CYCLE + 12), (POLYNOMIAL, 47),
                                            (WSD, STEPS - WSD_DECAY + 7)])
def test_resume_mid_cycle_is_bitwise(schedule, stop):
    """A scheduler rebuilt from another's state dict (through JSON, as train_state.json holds it)
    sets the same LR at every later step, across a restart and past the decay's end."""
    cfg = run_config(**schedule)
    opt_a = optimizer()
    a = lr_scheduler(cfg, opt_a)
    a.step(stop)
    state = json.loads(json.dumps(a.state_dict()))
    # Built from a config with other values: the checkpoint's win, as for megatron's own fields.
    changed = ({"restart_cycle_steps": 7, "restart_peak_decay": 0.9} if "restart_cycle_steps" in schedule else
               {"wsd_decay_steps": 40, "wsd_decay_style": "linear"} if "wsd_decay_steps" in schedule else
               {"decay_power": 3.0})
    opt_b = optimizer()
    b = lr_scheduler(run_config(**{**schedule, **changed}), opt_b)
    b.load_state_dict(state)
    assert b.num_steps == stop and opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    for _ in range(STEPS + 10 - stop):
        a.step(1)
        b.step(1)
        assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
        assert opt_b.param_groups[0]["weight_decay"] == opt_a.param_groups[0]["weight_decay"]
    assert b.state_dict() == a.state_dict()


@pytest.mark.parametrize("optimizer_section, key, message", [
    ({"decay_style": "cosine_restarts"}, "optimizer.restart_cycle_steps", "needs a cycle length > 0"),
    ({"decay_style": "cosine_restarts", "restart_cycle_steps": 0}, "optimizer.restart_cycle_steps",
     "needs a cycle length > 0"),
    ({**RESTARTS, "restart_peak_decay": 0.0}, "optimizer.restart_peak_decay", "must be in (0, 1]"),
    ({**RESTARTS, "restart_peak_decay": 1.5}, "optimizer.restart_peak_decay", "must be in (0, 1]"),
    ({"decay_style": "polynomial", "decay_power": 0.0}, "optimizer.decay_power", "must be > 0"),
    ({"decay_style": "polynomial", "decay_power": -1.0}, "optimizer.decay_power", "must be > 0"),
    ({"decay_style": "cosine", "restart_cycle_steps": 10}, "optimizer.restart_cycle_steps",
     "read only with decay_style cosine_restarts, not cosine: leave it at null"),
    ({"decay_style": "linear", "restart_peak_decay": 0.5}, "optimizer.restart_peak_decay",
     "read only with decay_style cosine_restarts, not linear"),
    ({**RESTARTS, "decay_power": 2.0}, "optimizer.decay_power", "read only with decay_style polynomial"),
    ({"decay_style": "sgdr"}, "optimizer.decay_style", "sgdr"),
    ({"decay_style": "wsd"}, "optimizer.wsd_decay_steps", "decay_style wsd needs the steps of its final decay"),
    ({**WSD, "wsd_decay_steps": 91}, "optimizer.wsd_decay_steps", "more than the 90 steps between warmup's end"),
    ({"decay_style": "cosine", "wsd_decay_steps": 10}, "optimizer.wsd_decay_steps",
     "read only with decay_style wsd, not cosine: leave it at null"),
    ({"decay_style": "linear", "wsd_decay_style": "cosine"}, "optimizer.wsd_decay_style",
     "read only with decay_style wsd, not linear: leave it at linear"),
])
def test_bad_schedule_names_the_key(optimizer_section, key, message):
    with pytest.raises(ConfigError) as err:
        run_config(**optimizer_section)
    assert err.value.key == key and message in str(err.value)


def test_preset_override_leaving_a_restart_key_is_refused():
    with pytest.raises(ConfigError) as err:
        load_run_config(str(preset_path("base")), ["optimizer.decay_style=cosine"])
    assert err.value.key == "optimizer.restart_cycle_steps"
    cfg = load_run_config(str(preset_path("base")),
                          ["optimizer.decay_style=cosine", "optimizer.restart_cycle_steps=null"])
    assert cfg.optimizer.decay_style == "cosine"


@pytest.mark.slow
def test_presets_schedules_and_plot(tmp_path):
    small, base, large = (lr_schedule_plot.preset_config(n) for n in ("small", "base", "large"))
    steps, lr = lr_schedule_plot.schedule(base, stride=1000)
    # Four cycles of 73,000 steps after 8,000 warmup steps, each from 3e-4 down towards 3e-5, ending at 3e-5.
    restarts = [s for s, prev, cur in zip(steps[1:], lr, lr[1:]) if cur > prev and s > 8000]
    assert restarts == [81_000, 154_000, 227_000]
    assert [lr[steps.index(s)] for s in (8000, *restarts)] == pytest.approx([3e-4] * 4, rel=1e-12)
    assert lr[-1] == 3e-4 * 0.1
    steps, lr = lr_schedule_plot.schedule(large, stride=1000)
    assert lr[steps.index(256_000)] == pytest.approx((2e-4 + 1e-5) / 2, rel=1e-12) and lr[-1] == 2e-4 * 0.05
    steps, lr = lr_schedule_plot.schedule(small, stride=1000)
    assert lr[steps.index(52_000)] == pytest.approx((5e-4 + 5e-5) / 2, rel=1e-12) and lr[-1] == 5e-4 * 0.1
    steps, lr = lr_schedule_plot.schedule(lr_schedule_plot.preset_config("small-wsd"), stride=1000)
    assert lr[steps.index(80_000)] == 5e-4 and lr[steps.index(90_000)] == pytest.approx((5e-4 + 5e-5) / 2, rel=1e-12)
    out = lr_schedule_plot.plot(list(lr_schedule_plot.PLOTTED), tmp_path / "lr.png", stride=1000)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
