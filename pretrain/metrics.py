"""What a run leaves behind on rank 0: metrics.jsonl, TensorBoard events, wandb, live progress."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Optional

import torch

# Dense bf16 peak per device (TFLOP/s), for MFU; matched against torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_peak_tflops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


class MetricsLogger:
    """One JSON object per log call in metrics.jsonl (appended, so a resumed run continues it),
    mirrored to TensorBoard and wandb. Only rank 0 constructs one."""

    def __init__(self, run_dir: Path, cfg_dict: dict, *, tensorboard: bool, wandb_mode: str,
                 wandb_project: str, total_steps: int, start_step: int, progress: bool):
        self.file = open(run_dir / "metrics.jsonl", "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.wandb = None
        if wandb_mode != "disabled":
            import wandb

            self.wandb = wandb.init(project=wandb_project, mode=wandb_mode, dir=str(run_dir),
                                    config=cfg_dict, resume="allow", id=run_dir.name)
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stderr,
                            dynamic_ncols=True)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step, split = record["step"], record["split"]
        scalars = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and k not in ("step",) and math.isfinite(v)}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(f"{split}/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"{split}/{k}": v for k, v in scalars.items()}, step=step)

    def progress(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None:
            self.bar.close()
