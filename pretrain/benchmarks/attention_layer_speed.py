"""Forward/backward time and counted FLOPs of one transformer layer per attention variant.

    python pretrain/benchmarks/attention_layer_speed.py [--hidden 768 --heads 12 --seq 512 --batch 2]
        [--variants vanilla ora ora_hadamard] [--repeats 10] [--out results.json]

One megatron-core TransformerLayer built from our spec (one process, TP=1), fp32 on whatever
device torch offers. Variants are timed round-robin, so machine noise hits them alike; the
ratios to the first variant are the figures to read. FLOPs are counted by torch's
FlopCounterMode on the same step (matmuls only), which shows the skipped Q/K weight gradients.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from megatron.core.transformer.spec_utils import build_module
from torch.utils.flop_counter import FlopCounterMode

from ora_megatron.builder import layer_spec, transformer_config
from ora_megatron.model_config import AttentionConfig, ModelConfig, ParallelConfig
from ora_megatron.parallel import destroy_distributed, init_distributed

VARIANTS = {
    "vanilla": AttentionConfig(type="vanilla"),
    "ora": AttentionConfig(type="ora"),
    "ora_hadamard": AttentionConfig(type="ora", orthogonal_method="hadamard"),
    "frozen_gaussian": AttentionConfig(type="frozen_gaussian"),
    "synthesizer_random": AttentionConfig(type="synthesizer_random"),
}


def build_layer(args, attention: AttentionConfig, device):
    model = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                        seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0, attention=attention)
    layer = build_module(layer_spec(model), config=transformer_config(model, ParallelConfig()), layer_number=1)
    return layer.to(device)


def step(layer, x) -> None:
    out = layer(x, attention_mask=None)[0]
    out.float().pow(2).mean().backward()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["vanilla", "ora", "ora_hadamard"], choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    init_distributed(1, 1)
    layers = {name: build_layer(args, VARIANTS[name], device) for name in args.variants}
    x = torch.randn(args.seq, args.batch, args.hidden, device=device, requires_grad=True)
    flops, times = {}, {name: [] for name in layers}
    for name, layer in layers.items():
        counter = FlopCounterMode(display=False)
        with counter:
            step(layer, x)
        flops[name] = counter.get_total_flops()
        step(layer, x)  # warm-up
    for _ in range(args.repeats):
        for name, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(layer, x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    destroy_distributed()
    first = args.variants[0]
    rows = [{"variant": name, "median_ms": 1e3 * statistics.median(times[name]),
             "ratio_time": statistics.median(times[name]) / statistics.median(times[first]),
             "gflops": flops[name] / 1e9, "ratio_flops": flops[name] / flops[first]} for name in layers]
    report = {"device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(),
              "threads": torch.get_num_threads(), "shape": vars(args), "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(f"{report['device']}, {report['threads']} threads, d={args.hidden} h={args.heads} "
          f"seq={args.seq} batch={args.batch}, fwd+bwd of one layer, {args.repeats} round-robin repeats")
    print(f"{'variant':<18}{'median ms':>10}{'× time':>8}{'GFLOP':>9}{'× FLOP':>8}")
    for r in rows:
        print(f"{r['variant']:<18}{r['median_ms']:>10.1f}{r['ratio_time']:>8.3f}{r['gflops']:>9.2f}{r['ratio_flops']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
