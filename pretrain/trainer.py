"""The training loop: steps, evaluation, checkpoints, resume, skips and preemption."""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import get_flattened_grad_norm
from deepspeed.utils import safe_get_local_grad, safe_get_local_optimizer_state
from megatron.core import parallel_state

from ora_megatron.builder import padded_vocab_size
from ora_megatron.summary import train_flops_per_token
from pretrain import checkpoint
from pretrain.config import RunConfig
from pretrain.data import BatchOrder, build_datasets, build_tokenizer, collate
from pretrain.engine import Engine, MegatronMPU, build_engine, link_optimizer_fragments, lm_loss
from pretrain.freeze import apply_freeze_stage, freeze_stage_index
from pretrain.metrics import MetricsLogger, device_peak_tflops, peak_memory_bytes


class TrainingStopped(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite steps); a checkpoint was saved."""


@dataclass
class TrainState:
    """Everything besides model/optimizer that a resumed run needs; saved as train_state.json."""

    step: int = 0  # optimizer steps attempted (applied + skipped)
    skipped_steps: int = 0
    consecutive_skips: int = 0
    tokens_seen: int = 0
    best_valid_loss: float = math.inf
    evals_without_improvement: int = 0
    freeze_stage: int = -1
    scheduler: dict = field(default_factory=dict)


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, grad_accum: int):
        self.cfg, self.grad_accum = cfg, grad_accum
        self.ckpt_dir = run_dir / "checkpoints"
        self.datasets = build_datasets(cfg, build_tokenizer(cfg), run_dir / "data_cache")
        self.state = TrainState()  # freeze_stage -1: the attention config's own trainability
        self.eng: Engine = build_engine(cfg, grad_accum)
        self.param_counts = parameter_counts(self.eng.module, self.eng.pipelined)
        self.grad_bytes: Optional[int] = None  # measured once per trainable set, see _train_step
        self._enter_freeze_stage(freeze_stage_index(cfg, 0))
        self.order = BatchOrder(cfg.train.micro_batch_size, grad_accum, *self._dp_rank_size())
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_token = train_flops_per_token(cfg.model, padded_vocab_size(cfg.model))
        self.stop_requested = False

    # ------------------------------------------------------------------ setup helpers
    def _dp_rank_size(self) -> tuple[int, int]:
        if self.eng.pipelined:
            grid = self.eng.engine.grid
            return grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def _enter_freeze_stage(self, index: int) -> None:
        if index != self.state.freeze_stage:
            self.eng = apply_freeze_stage(self.cfg, self.eng, index, self.grad_accum)
            self.state.freeze_stage = index
            self.param_counts = parameter_counts(self.eng.module, self.eng.pipelined)
            self.grad_bytes = None

    def resume(self) -> bool:
        tag = checkpoint.latest_tag(self.ckpt_dir)
        if tag is None:
            return False
        saved = TrainState(**checkpoint.read_train_state(self.ckpt_dir, tag))
        self._enter_freeze_stage(saved.freeze_stage)  # the optimizer must hold the saved trainable set
        checkpoint.load(self.eng.engine, self.ckpt_dir, tag)
        self.state = saved
        self.eng.scheduler.load_state_dict(self.state.scheduler)
        checkpoint.restore_frozen_qk(self.eng.module)
        return True

    # ------------------------------------------------------------------ one step
    def _micro_batch(self, split: str, step: int, micro: int) -> dict:
        return collate(self.datasets[split], self.order.indices(step, micro))

    def _micro_loss(self, split: str, step: int, micro: int) -> torch.Tensor:
        batch = self._micro_batch(split, step, micro)
        return lm_loss(self.eng.engine(batch["tokens"]), (batch["labels"], batch["loss_mask"]))

    def _pipe_batches(self, split: str, step: int):
        """One step's micro-batches as DeepSpeed's pipeline engine takes them: (inputs, labels)."""
        batches = [self._micro_batch(split, step, m) for m in range(self.grad_accum)]
        return iter([(b["tokens"], (b["labels"], b["loss_mask"])) for b in batches])

    def _train_step(self, step: int) -> float:
        engine = self.eng.engine
        if self.eng.pipelined:
            return engine.train_batch(data_iter=self._pipe_batches("train", step)).item()
        losses = []
        poison = step + 1 in self.cfg.train.inject_nonfinite_loss_steps
        for micro in range(self.grad_accum):
            loss = self._micro_loss("train", step, micro)
            if poison:
                loss = loss * float("nan")
            engine.backward(loss)
            if micro == self.grad_accum - 1:
                if self.grad_bytes is None:  # gradient storage only changes with the trainable set
                    self.grad_bytes = _local_grad_bytes(engine)
                if self.cfg.deepspeed.zero_stage == 0:  # DeepSpeed clips but does not keep the norm here
                    trainable = [p for p in engine.module.parameters() if p.requires_grad]
                    self.zero0_grad_norm = float(get_flattened_grad_norm(trainable, mpu=MegatronMPU()))
            engine.step()
            losses.append(loss.detach())
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        return loss.item() / parallel_state.get_data_parallel_world_size()

    @torch.no_grad()
    def evaluate(self, split: str) -> Optional[float]:
        if self.datasets.get(split) is None:
            return None
        engine = self.eng.engine
        engine.eval()
        losses = []
        for i in range(self.cfg.train.eval_iters):
            if self.eng.pipelined:
                losses.append(engine.eval_batch(data_iter=self._pipe_batches(split, i)).float())
            else:
                losses += [self._micro_loss(split, i, micro) for micro in range(self.grad_accum)]
        engine.train()
        loss = torch.stack(losses).mean()
        if not self.eng.pipelined:
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss = loss / parallel_state.get_data_parallel_world_size()
        return loss.item()

    # ------------------------------------------------------------------ the loop
    def save(self) -> None:
        self.state.scheduler = self.eng.scheduler.state_dict()
        checkpoint.save(self.eng.engine, self.ckpt_dir, self.state.step, asdict(self.state),
                        self.cfg.checkpoint.keep_last)

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            self.stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def _all_ranks_agree(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def train(self, logger: Optional[MetricsLogger]) -> dict:
        cfg = self.cfg.train
        self._install_signal_handlers()
        start_time = time.time()
        peak_tflops = device_peak_tflops()
        train_loss = float("nan")
        stopped_early = preempted = False
        while self.state.step < cfg.steps:
            step = self.state.step
            self._enter_freeze_stage(freeze_stage_index(self.cfg, step))
            self.eng.scheduler.step(1)  # lr for this update (megatron's warmup starts at step 1)
            skipped_before = self.eng.engine.skipped_steps
            t0 = time.time()
            train_loss = self._train_step(step)
            step_time = time.time() - t0
            skipped = self.eng.engine.skipped_steps > skipped_before
            self.state.step += 1
            self.state.tokens_seen += self.tokens_per_step
            self.state.skipped_steps += int(skipped)
            self.state.consecutive_skips = self.state.consecutive_skips + 1 if skipped else 0
            tokens_per_s = self.tokens_per_step / step_time
            if logger is not None and (self.state.step % cfg.log_interval == 0 or skipped):
                record = {"step": self.state.step, "split": "train", "loss": train_loss,
                          "lr": self.eng.scheduler.get_lr(self.eng.engine.optimizer.param_groups[0]),
                          "grad_norm": self._grad_norm(), "tokens_per_s": tokens_per_s,
                          "step_time_s": step_time, "skipped_steps": self.state.skipped_steps,
                          "trainable_params": self.param_counts[0],
                          "peak_mem_bytes": peak_memory_bytes()}
                if peak_tflops is not None:
                    per_device = self.flops_per_token * tokens_per_s / dist.get_world_size() / 1e12
                    record.update(tflops_per_device=per_device, mfu=per_device / peak_tflops)
                logger.log(record)
                logger.progress(self.state.step, train_loss, record["lr"], tokens_per_s)
            if self.state.consecutive_skips >= cfg.max_consecutive_skips:
                self.save()
                raise TrainingStopped(
                    f"{self.state.consecutive_skips} consecutive steps had non-finite loss or gradients "
                    f"(step {self.state.step}); stopped, last good state saved in {self.ckpt_dir}")
            if self.state.step % cfg.eval_interval == 0 or self.state.step == cfg.steps:
                stopped_early = self._evaluate_and_check(logger)
            if self.state.step % self.cfg.checkpoint.save_interval == 0 or self.state.step == cfg.steps or stopped_early:
                self.save()
            if self._all_ranks_agree(self.stop_requested):
                if self.state.step % self.cfg.checkpoint.save_interval != 0:
                    self.save()
                preempted = True
                break
            if stopped_early:
                break
        result = {"final_train_loss": train_loss, "wall_time_s": time.time() - start_time,
                  "steps": self.state.step, "stopped_early": stopped_early, "preempted": preempted}
        if not preempted:
            result["final_test_loss"] = self.evaluate("test")
            if logger is not None and result["final_test_loss"] is not None:
                logger.log({"step": self.state.step, "split": "test", "loss": result["final_test_loss"],
                            "ppl": math.exp(min(result["final_test_loss"], 50.0))})
        return result

    def _evaluate_and_check(self, logger: Optional[MetricsLogger]) -> bool:
        """Validation loss/ppl; returns True when early stopping says stop."""
        loss = self.evaluate("valid")
        if loss is None:
            return False
        self.last_valid_loss = loss
        if logger is not None:
            logger.log({"step": self.state.step, "split": "valid", "loss": loss, "ppl": math.exp(min(loss, 50.0))})
        early = self.cfg.train.early_stopping
        if loss < self.state.best_valid_loss - early.min_delta:
            self.state.best_valid_loss, self.state.evals_without_improvement = loss, 0
        else:
            self.state.evals_without_improvement += 1
        return early.enabled and self.state.evals_without_improvement >= early.patience


    def _grad_norm(self) -> Optional[float]:
        norm = self.eng.engine.get_global_grad_norm()
        if norm is None:
            norm = getattr(self, "zero0_grad_norm", None)
        return float(norm) if norm is not None else None

    # ------------------------------------------------------------------ accounting
    def allocated_state(self) -> dict:
        """Adam-moment and gradient bytes this rank holds, read from the live tensors."""
        engine = self.eng.engine
        link_optimizer_fragments(engine)
        moments = [m for p in engine.module.parameters() if p.requires_grad
                   for key in ("exp_avg", "exp_avg_sq") if (m := _local_optimizer_state(engine, p, key)) is not None]
        return {
            "optimizer_state_elements": sum(m.numel() for m in moments),
            "optimizer_state_bytes": sum(m.numel() * m.element_size() for m in moments),
            "gradient_bytes": self.grad_bytes or 0,
        }


def parameter_counts(module: torch.nn.Module, pipelined: bool) -> tuple[int, int]:
    """(trainable, frozen) elements of the whole model; a collective over all ranks.

    Each rank counts its tensor-parallel shards, replicated weights only on TP rank 0, and a
    pipeline's tied embedding only on the first stage; the sum over ranks covers every data-
    parallel replica, hence the division. ZeRO-3 keeps a partitioned weight's size in ds_numel.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    counts = torch.zeros(2, dtype=torch.float64)
    for name, p in module.named_parameters():
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        if pipelined and name.startswith("tied_modules.") and module.stage_id != 0:
            continue
        counts[0 if p.requires_grad else 1] += getattr(p, "ds_numel", p.numel())
    dist.all_reduce(counts)
    replicas = dist.get_world_size() // (module.num_stages if pipelined else 1) // parallel_state.get_tensor_model_parallel_world_size()
    return int(counts[0].item()) // replicas, int(counts[1].item()) // replicas


def _local_optimizer_state(engine, param, key) -> Optional[torch.Tensor]:
    """This rank's part of `param`'s optimizer state: its ZeRO fragment, or the whole tensor."""
    if hasattr(param, "ds_id"):  # ZeRO-3
        return safe_get_local_optimizer_state(param, key)
    if hasattr(param, "_hp_mapping"):  # ZeRO-1/2 and DeepSpeed's bf16 optimizer
        mapping = param._hp_mapping  # None, or no state yet: this rank holds none of it
        return mapping.get_optim_state_fragment(key) if mapping and key in mapping.get_optim_state_keys() else None
    state = engine.optimizer.state.get(param, {})
    return state.get(key)


def _local_grad_bytes(engine) -> int:
    """Bytes of gradient this rank holds at the end of a step's backward (ZeRO partitions included)."""
    tensors = []
    for p in engine.module.parameters():
        if p.requires_grad:
            tensors.append(safe_get_local_grad(p) if hasattr(p, "ds_id") else p.grad)
    averaged = getattr(engine.optimizer, "averaged_gradients", {})  # ZeRO-2's reduced partitions
    tensors += [t for grads in averaged.values() if grads for t in grads]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
