"""The ops one micro-batch's forward and backward dispatches on CUDA, traced on CPU.

The model is built as training builds it (`ora_megatron.stages.build_staged_gpt`, cast to bf16 as
DeepSpeed's bf16 engine casts it) inside `ora_megatron.device_branches.cuda_branches`, so every choice
by device takes its CUDA branch (FlexAttention for document masks, megatron-core's fused
bias-dropout-add, Hadamard Q/K over all tokens at once). A `TorchDispatchMode` records each aten op
with its tensors' shapes, element sizes, identities and the elements their strides reach; the calls
that are one CUDA kernel on the GPU are recorded as one op each and stood in for on CPU, their own ops
unrecorded:

- `scaled_dot_product_attention` (cuDNN/flash) and FlexAttention (compiled): "attention" forward and
  backward, with [b, heads, s, d];
- the fused loss (`StagedGPT.fused_loss`, `ora_megatron.cross_entropy.linear_cross_entropy`): one
  "loss" op each way with its tokens, width and vocabulary, replaced by the kernels of
  `pretrain.research.speed.code_versions.loss_ops` for the loss's code at the revision predicted;
- megatron-core's bias-dropout-add, compiled by megatron on CUDA: one "fused" op.

The model runs at micro-batches 2 and 3 with the real sequence length: every shape is affine in the
micro-batch (tokens, batch), so `Trace.at(micro_batch)` gives the shapes of any micro-batch, the
attention's s² terms exact. Micro-batch 1 is traced as it is (`trace_at_one`): there some layout changes
are no-ops and launch nothing, which the affine extension would not see. The optimizer's step is not
traced (DeepSpeed's ZeRO optimizer needs a GPU): `pretrain.research.speed.code_versions.optimizer_ops`
models it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# aten ops that launch no kernel: allocations and metadata (views are found by their schema).
NO_KERNEL = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
             "alias", "lift_fresh", "resize_", "set_", "_local_scalar_dense", "is_same_size", "_to_copy_meta"}


@dataclass(frozen=True)
class Tensor:
    """A tensor an op reads or writes: its shape, element size, identity (views share their base's) and the
    elements its strides reach (fewer than its shape's for broadcast or overlapping views: the bytes read)."""

    shape: tuple[int, ...]
    itemsize: int
    ident: int
    elements: int

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize


@dataclass(frozen=True)
class Op:
    """One dispatched op. kind: "gemm", "attention", "loss", "fused", "memory" (a memory-bound kernel),
    "view" (no kernel). `args`: what the kind's cost needs beyond shapes (e.g. attention's causal flag)."""

    name: str
    kind: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    backward: bool
    args: tuple = ()


GEMMS = {"mm", "addmm", "bmm", "baddbmm"}


def op_kind(name: str, is_view: bool) -> str:
    if is_view or name in NO_KERNEL:
        return "view"
    return "gemm" if name in GEMMS else "memory"


def reached_elements(t: torch.Tensor) -> int:
    """The elements a strided tensor's indices reach: its numel, or its span where that is smaller."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return min(t.numel(), span)


@dataclass
class Recorder:
    ops: list[Op] = field(default_factory=list)
    idents: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    next_ident: int = 0
    backward: bool = False
    quiet: int = 0

    def ident(self, tensor: torch.Tensor, alias_of: int | None = None) -> int:
        if tensor not in self.idents:
            if alias_of is None:
                alias_of, self.next_ident = self.next_ident, self.next_ident + 1
            self.idents[tensor] = alias_of
        return self.idents[tensor]

    def described(self, tensors, alias_of: int | None = None) -> tuple[Tensor, ...]:
        return tuple(Tensor(tuple(t.shape), t.element_size(), self.ident(t, alias_of), reached_elements(t))
                     for t in tensors if isinstance(t, torch.Tensor))

    def record(self, name: str, kind: str, inputs, outputs, args: tuple = ()) -> None:
        ins = self.described(inputs)
        alias = ins[0].ident if kind == "view" and ins else None
        self.append(Op(name, kind, ins, self.described(outputs, alias), self.backward, args))

    def append(self, op: Op) -> None:
        if not self.quiet:
            self.ops.append(op)

    @contextlib.contextmanager
    def silenced(self) -> Iterator[None]:
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.recorder.quiet:
            name = func.overloadpacket.__name__
            inputs, _ = tree_flatten((args, kwargs or {}))
            outputs, _ = tree_flatten(out)
            self.recorder.record(name, op_kind(name, func.is_view), inputs, outputs)
        return out


@dataclass(frozen=True)
class _StandInCall:
    recorder: Recorder
    name: str
    kind: str
    output: tuple[torch.Size, torch.dtype]
    args: tuple
    backward_name: str | None


class _StandIn(torch.autograd.Function):
    """One recorded op each way. It keeps no tensor: a class defined per call whose closure held the inputs
    outlived the autograd graph (a cycle through the graph's C++ nodes that Python's collector cannot see),
    keeping every traced model's parameters and activations alive."""

    @staticmethod
    def forward(ctx, call: _StandInCall, *tensors):
        recorder = call.recorder
        metas = recorder.described(tensors)
        with recorder.silenced():
            out = torch.zeros(call.output[0], dtype=call.output[1])
        recorder.append(Op(call.name, call.kind, metas, recorder.described([out]), recorder.backward, call.args))
        ctx.call, ctx.metas = call, metas
        ctx.inputs = [(t.shape, t.dtype) for t in tensors]
        return out

    @staticmethod
    def backward(ctx, grad):
        call, recorder = ctx.call, ctx.call.recorder
        with recorder.silenced():
            grads = tuple(torch.zeros(shape, dtype=dtype) if needed else None
                          for (shape, dtype), needed in zip(ctx.inputs, ctx.needs_input_grad[1:]))
        if call.backward_name is not None:
            written = recorder.described([g for g in grads if g is not None])
            recorder.append(Op(call.backward_name, call.kind, (*recorder.described([grad]), *ctx.metas),
                               written, True, call.args))
        return (None, *grads)


def stand_in(recorder: Recorder, name: str, kind: str, output: tuple[torch.Size, torch.dtype],
             inputs: tuple[torch.Tensor, ...], args: tuple = (), backward_name: str | None = None):
    """Record one op forward (and `backward_name` backward, reading the output's gradient and the inputs),
    returning zeros of the real output's shape: the real kernel's values do not change which ops follow."""
    return _StandIn.apply(_StandInCall(recorder, name, kind, output, args, backward_name), *inputs)


class _AttentionRecorder(TorchFunctionMode):
    """scaled_dot_product_attention as one op each way (cuDNN's flash kernels on the GPU)."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        causal = bool(kwargs.get("is_causal", False)) or kwargs.get("attn_mask") is not None
        dropout = float(kwargs.get("dropout_p", 0.0)) > 0
        return stand_in(self.recorder, "sdpa", "attention", (q.shape[:-1] + v.shape[-1:], q.dtype), (q, k, v),
                        args=(causal, dropout), backward_name="sdpa_backward")


@contextlib.contextmanager
def _patched(target, name: str, value) -> Iterator[None]:
    before = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, before)


def _one_kernel_calls(recorder: Recorder, model: torch.nn.Module):
    """Patches standing in for the calls that are one op on the GPU (the module docstring)."""
    import megatron.core.fusions.fused_bias_dropout as bias_dropout

    import ora_megatron.attention as attention

    def flex(q, k, v, block_mask, scale, enable_gqa):
        return stand_in(recorder, "flex_attention", "attention", (q.shape[:-1] + v.shape[-1:], q.dtype),
                        (q, k, v), args=(True, False), backward_name="flex_attention_backward")

    def fused_loss(hidden, weight, labels, loss_mask):
        tokens = hidden.reshape(-1, hidden.size(-1))
        return stand_in(recorder, "linear_cross_entropy", "loss", (torch.Size([]), torch.float32),
                        (tokens, weight), backward_name="linear_cross_entropy_backward")

    def bias_dropout_add(x_with_bias, residual, prob):
        x, bias = x_with_bias
        inputs = (x, residual) if bias is None else (x, bias, residual)
        return stand_in(recorder, "bias_dropout_add", "fused", (residual.shape, residual.dtype), inputs,
                        backward_name="bias_dropout_add_backward")

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(attention, "flex_document_attention", flex))
    stack.enter_context(_patched(model, "fused_loss", fused_loss))
    stack.enter_context(_patched(bias_dropout, "bias_dropout_add_fused_train", bias_dropout_add))
    return stack


@contextlib.contextmanager
def _torch_linear() -> Iterator[None]:
    """torch's own F.linear for the block: a ZeRO-3 engine built earlier in this process has replaced it
    with DeepSpeed's (its "memory efficient linear", which "will persist unless manually reset"), a matmul
    and an add where the traced step, ZeRO-1/2's, runs one addmm."""
    patched = torch.nn.functional.linear
    torch.nn.functional.linear = torch._C._nn.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = patched


def traced_ops(cfg, micro_batch: int) -> list[Op]:
    """The ops of one micro-batch's forward and backward at `micro_batch` (megatron's parallel state
    must be set up for tensor and pipeline size 1)."""
    from ora_megatron.device_branches import cuda_branches
    from ora_megatron.stages import build_staged_gpt

    model_cfg = cfg.model
    torch.manual_seed(model_cfg.seed)
    with cuda_branches():
        model = build_staged_gpt(model_cfg, cfg.parallel).to(torch.bfloat16).train()
    shape = (micro_batch, model_cfg.seq_length)
    tokens = torch.randint(0, model_cfg.vocab_size, shape)
    batch = {}
    if cfg.data.reset_attention_mask:
        half = model_cfg.seq_length // 2  # two documents a sequence
        batch["document_ids"] = (torch.arange(model_cfg.seq_length) >= half).long().expand(shape)
        batch["position_ids"] = (torch.arange(model_cfg.seq_length) % half).expand(shape)
    recorder = Recorder()
    with cuda_branches(), _torch_linear(), _one_kernel_calls(recorder, model), _AttentionRecorder(recorder), \
            _DispatchRecorder(recorder):
        # A first, unrecorded step builds what the model caches on its first call (Hadamard Q/K's index
        # maps, ORA's frozen Q/K): training repeats the steady step, not the first.
        for recorded in (False, True):
            with contextlib.nullcontext() if recorded else recorder.silenced():
                recorder.backward = False
                loss = model(tokens, (tokens, torch.ones(shape)), **batch)
                recorder.backward = True
                loss.backward()
            model.zero_grad(set_to_none=True)
    return recorder.ops


@dataclass(frozen=True)
class Trace:
    """One micro-batch's ops at micro-batches 2 and 3; `at(m)` extends each size affinely to m (m ≥ 2)."""

    at_two: tuple[Op, ...]
    at_three: tuple[Op, ...]
    parameters: tuple[tuple[int, ...], ...]  # the trainable parameters' shapes (for the optimizer)

    def at(self, micro_batch: int) -> list[Op]:
        return [_scaled(a, b, micro_batch) for a, b in zip(self.at_two, self.at_three)]


def _scaled_tensor(a: Tensor, b: Tensor, micro_batch: int) -> Tensor:
    shape = tuple(x + (y - x) * (micro_batch - 2) for x, y in zip(a.shape, b.shape))
    return replace(a, shape=shape, elements=a.elements + (b.elements - a.elements) * (micro_batch - 2))


def _scaled(a: Op, b: Op, micro_batch: int) -> Op:
    if (a.name, len(a.inputs), len(a.outputs)) != (b.name, len(b.inputs), len(b.outputs)):
        raise RuntimeError(f"the traces at micro-batches 2 and 3 differ at {a.name} / {b.name}")
    return replace(a, inputs=tuple(_scaled_tensor(x, y, micro_batch) for x, y in zip(a.inputs, b.inputs)),
                   outputs=tuple(_scaled_tensor(x, y, micro_batch) for x, y in zip(a.outputs, b.outputs)))


def trace(cfg) -> Trace:
    """The trace of `cfg`'s model (tensor and pipeline size 1) on CPU, in megatron's TP=1 state: joined if
    the caller holds it, else set up and torn down around the trace."""
    from ora_megatron.stages import build_staged_gpt
    from pretrain.checkpoint.consolidate import tp1_parallel_state

    with tp1_parallel_state():
        two, three = traced_ops(cfg, 2), traced_ops(cfg, 3)
        with torch.device("meta"):
            model = build_staged_gpt(cfg.model, cfg.parallel)
        shapes = tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    if len(two) != len(three):
        raise RuntimeError(f"the traces at micro-batches 2 and 3 differ in length: {len(two)} / {len(three)}")
    return Trace(tuple(two), tuple(three), shapes)


def trace_at_one(cfg) -> tuple[Op, ...]:
    """The ops of one micro-batch of 1 sequence, traced as `trace` traces (the module docstring)."""
    from pretrain.checkpoint.consolidate import tp1_parallel_state

    with tp1_parallel_state():
        return tuple(traced_ops(cfg, 1))
