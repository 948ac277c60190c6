"""A reference GPT (a Python file defining nanoGPT's `GPT` and `GPTConfig`) traced as its trainer runs it
on CUDA, for the op audit (`pretrain.research.speed.audit`).

The reference is nanoGPT's `model.py` or any file with the same interface: `GPTConfig(block_size,
vocab_size, n_layer, n_head, n_embd, dropout, bias)`, `GPT(config)` whose `forward(idx, targets)` returns
`(logits, loss)`. It is loaded from its path, never copied into the project. Its trainer
(nanoGPT's train.py, the side-by-side runner of the GPU report) keeps fp32 weights and runs each
micro-batch's forward under CUDA autocast in bf16, then `(loss / accumulation).backward()`; after the
last micro-batch it clips the gradient norm to 1.0 and steps a fused AdamW.

The micro-batch is traced on CPU as the speed model traces ours (`pretrain.research.speed.trace`), under
CPU autocast in bf16. For the ops a GPT uses, CPU autocast picks the dtypes CUDA's does (linears and
attention in bf16; layer norm and cross entropy on the fp32 inputs the trainer hands them). Two calls
dispatch differently on CPU and are recorded as CUDA runs them:

- scaled_dot_product_attention: one flash kernel each way (the speed model's attention stand-in);
- dropout: CUDA's `native_dropout`, one kernel writing the output and a bool mask, and one backward
  reading the mask (CPU draws, divides and multiplies in three).

The optimizer is not traced (its fused kernels exist on CUDA only): `reference_optimizer_ops` models it
as `code_versions.optimizer_ops` models ours.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from pretrain.research.speed.code_versions import FUSED_ADAMW_BYTES_PER_PARAM, _memory, launched_ops
from pretrain.research.speed.trace import Op, Recorder, Trace, _AttentionRecorder, _DispatchRecorder


@dataclass(frozen=True)
class ReferenceShape:
    """The shape the reference is built at: the project model's."""

    layers: int
    width: int
    heads: int
    seq: int
    vocab: int
    dropout: float
    bias: bool = True


def load_reference(path: str | Path):
    """The reference file's module (executed once per path)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no reference model file at {path}")
    name = f"_speed_reference_{abs(hash(str(path)))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    for attribute in ("GPT", "GPTConfig"):
        if not hasattr(module, attribute):
            raise ValueError(f"{path} defines no {attribute} (the reference needs nanoGPT's GPT and GPTConfig)")
    return module


def build_reference(path: str | Path, shape: ReferenceShape) -> torch.nn.Module:
    module = load_reference(path)
    config = module.GPTConfig(block_size=shape.seq, vocab_size=shape.vocab, n_layer=shape.layers,
                              n_head=shape.heads, n_embd=shape.width, dropout=shape.dropout, bias=shape.bias)
    return module.GPT(config).train()


class _DropoutRecorder(TorchFunctionMode):
    """F.dropout in training as CUDA runs it: `native_dropout` (output and a bool mask) and its backward."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.dropout:
            return func(*args, **kwargs)
        x = args[0]
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        if not training or not 0 < p < 1:
            return func(*args, **kwargs)
        return _native_dropout(self.recorder, x)


def _native_dropout(recorder: Recorder, x: torch.Tensor) -> torch.Tensor:
    with recorder.silenced():
        mask = torch.ones(x.shape, dtype=torch.bool)
    mask_meta = recorder.described([mask])
    x_meta = recorder.described([x])

    class NativeDropout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            with recorder.silenced():
                out = tensor.clone()
            recorder.ops.append(Op("native_dropout", "memory", x_meta, (*recorder.described([out]), *mask_meta),
                                   recorder.backward))
            return out

        @staticmethod
        def backward(ctx, grad):
            with recorder.silenced():
                grad_in = grad.clone()
            recorder.ops.append(Op("native_dropout_backward", "memory", (*recorder.described([grad]), *mask_meta),
                                   recorder.described([grad_in]), True))
            return grad_in

    return NativeDropout.apply(x)


def traced_reference_ops(model: torch.nn.Module, shape: ReferenceShape, micro_batch: int,
                         accumulation: int) -> list[Op]:
    """The ops of one micro-batch's forward under bf16 autocast, `loss / accumulation`, and backward."""
    tokens = torch.randint(0, shape.vocab, (micro_batch, shape.seq))
    targets = torch.randint(0, shape.vocab, (micro_batch, shape.seq))
    recorder = Recorder()
    with _AttentionRecorder(recorder), _DropoutRecorder(recorder), _DispatchRecorder(recorder):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(tokens, targets)
        scaled = loss / accumulation
        recorder.backward = True
        scaled.backward()
    model.zero_grad(set_to_none=True)
    return recorder.ops


def trace_reference(path: str | Path, shape: ReferenceShape, accumulation: int) -> Trace:
    """The reference's micro-batch at micro-batches 2 and 3 (`Trace.at` extends it to any micro-batch)."""
    torch.manual_seed(0)
    model = build_reference(path, shape)
    two = traced_reference_ops(model, shape, 2, accumulation)
    three = traced_reference_ops(model, shape, 3, accumulation)
    if len(two) != len(three):
        raise RuntimeError(f"the reference's traces at micro-batches 2 and 3 differ: {len(two)} / {len(three)} ops")
    shapes = tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    return Trace(tuple(two), tuple(three), shapes)


def reference_optimizer_ops(shapes: list[tuple[int, ...]], micro_batches: int) -> list[Op]:
    """The reference trainer's gradient accumulation and optimizer step over fp32 parameters of `shapes`:
    autograd adds each micro-batch's gradient after the first into the parameter's (12 B an element);
    `clip_grad_norm_` (foreach on CUDA: the per-tensor norms, their norm, the clip factor, the scale);
    fused AdamW, one multi_tensor_apply per parameter group (nanoGPT decays the matrices, not the
    vectors), plus the step counters' increment."""
    sizes = [math.prod(shape) for shape in shapes]
    ops = [_memory("gradients.accumulate", size, 12) for _ in range(micro_batches - 1) for size in sizes]
    ops += launched_ops("optimizer.clip_norms", sizes, 1, 4)
    ops += [_memory("optimizer.clip_total", len(sizes), 8) for _ in range(4)]  # stack, norm, add-eps-divide, clamp
    ops += launched_ops("optimizer.clip_scale", sizes, 1, 8)
    groups = [[s for s, shape in zip(sizes, shapes) if len(shape) >= 2],
              [s for s, shape in zip(sizes, shapes) if len(shape) < 2]]
    for group in (g for g in groups if g):
        ops += launched_ops("optimizer.step_count", group, 1, 8)
        ops += launched_ops("optimizer.fused_adamw", group, 4, FUSED_ADAMW_BYTES_PER_PARAM)
    return ops
