"""The nanoGPT `shakespeare_char` CPU yardstick, run through our whole stack.

    python pretrain/benchmarks/nanogpt_shakespeare.py --input ../shared/data/tinyshakespeare.txt \
        [--out-dir runs/bench/shakespeare] [--steps 2000] [--attention vanilla ora]

Recipe (nanoGPT README, CPU): char-level, first 90% of the text for training and the last 10%
for validation; 4 layers, 4 heads, d=128, block 64, batch 12, lr 1e-3 with 100 warmup steps and
cosine decay to 1e-4 at 2000, beta2 0.99, dropout 0, 2000 steps, one process. nanoGPT reaches a
validation loss of 1.886 (68 s wall on a 2-core machine, see DESIGN.md).

Stages, each through the real entry points: data_tools.train_tokenizer (sentencepiece char
model), data_tools.build_shards (one document per split file), pretrain/pretrain_ora.py (one
process, ZeRO-0, fp32), once per attention type, back to back. Writes results.json and prints a
table: final validation loss, median tokens/s, train wall time, process wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pretrain.run_dir import RunDir

REPO = Path(__file__).resolve().parents[2]
NANOGPT_VAL_LOSS = 1.886


def run(args: list[str]) -> None:
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)


def prepare_data(text_path: Path, data_dir: Path) -> tuple[Path, Path, Path, int]:
    """Split 90/10 by characters, train a char tokenizer on the train part, shard both parts."""
    text = text_path.read_text()
    cut = int(0.9 * len(text))
    data_dir.mkdir(parents=True, exist_ok=True)
    parts = {"train": text[:cut], "valid": text[cut:]}
    for name, part in parts.items():
        (data_dir / f"{name}.txt").write_text(part)
    # sentencepiece reads text line by line: newlines are unseen and map to <unk>, one token per
    # newline, so a token is still a character. 4 = unk, bos, eos, pad.
    vocab = len(set(parts["train"]) - {"\n"}) + 4
    tokenizer = data_dir / "tokenizer" / "sp"
    run(["-m", "data_tools.train_tokenizer", "--input", str(data_dir / "train.txt"), "--txt-mode", "file",
         "--model-prefix", str(tokenizer), "--vocab-size", str(vocab), "--model-type", "char"])
    for name in parts:
        run(["-m", "data_tools.build_shards", "--input", str(data_dir / f"{name}.txt"), "--txt-mode", "file",
             "--tokenizer", f"{tokenizer}.model", "--output-dir", str(data_dir / f"shards_{name}"), "--quiet"])
    return data_dir / "shards_train", data_dir / "shards_valid", Path(f"{tokenizer}.model"), vocab


def run_config(attention: str, steps: int, vocab: int, train_shards: Path, valid_shards: Path, tokenizer: Path) -> dict:
    from data_tools.manifest import blend_from_manifest

    def blend(shards: Path) -> list[dict]:
        prefixes, weights = blend_from_manifest(str(shards))["train"]
        return [{"path": p, "weight": w} for p, w in zip(prefixes, weights)]

    return {
        "model": {"family": "gpt2", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                  "ffn_hidden_size": 512, "seq_length": 64, "vocab_size": vocab,
                  "make_vocab_size_divisible_by": 1, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                  "seed": 1337, "attention": {"type": attention}},
        "train": {"micro_batch_size": 12, "global_batch_size": 12, "steps": steps, "log_interval": 10,
                  "eval_interval": steps, "eval_iters": 20},
        "optimizer": {"lr": 1e-3, "min_lr_ratio": 0.1, "warmup_steps": 100, "decay_style": "cosine",
                      "decay_steps": steps, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "clip_grad": 1.0},
        "data": {"train_blend": blend(train_shards), "valid_blend": blend(valid_shards),
                 "test_blend": blend(valid_shards), "tokenizer": str(tokenizer)},
        "deepspeed": {"zero_stage": 0, "precision": "fp32"},
        "logging": {"wandb_mode": "disabled", "tensorboard": False, "progress": False},
        "checkpoint": {"save_interval": steps, "keep_last": 1},
    }


def train(out_dir: Path, attention: str, config: dict) -> dict:
    config_path = out_dir / f"{attention}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_dir = out_dir / f"run_{attention}"
    started = time.time()
    run([str(REPO / "pretrain" / "pretrain_ora.py"), "--config", str(config_path), "--run-dir", str(run_dir)])
    process_wall = time.time() - started
    summary = RunDir(run_dir).read_summary()
    speeds = [r.tokens_per_s for r in RunDir(run_dir).read_records("train")][1:]  # first step warms up
    return {"attention": attention, "final_valid_loss": summary.final_valid_loss,
            "median_tokens_per_s": statistics.median(speeds), "train_wall_s": summary.wall_time_s,
            "process_wall_s": process_wall, "trainable_params": summary.trainable_params,
            "frozen_params": summary.frozen_params, "run_dir": str(run_dir)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--out-dir", type=Path, default=REPO / "runs" / "bench" / "shakespeare")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--attention", nargs="+", default=["vanilla", "ora"])
    args = parser.parse_args(argv)
    out_dir = args.out_dir.resolve()
    train_shards, valid_shards, tokenizer, vocab = prepare_data(args.input.resolve(), out_dir / "data")
    results = [train(out_dir, attention,
                     run_config(attention, args.steps, vocab, train_shards, valid_shards, tokenizer))
               for attention in args.attention]
    report = {"recipe": "nanoGPT shakespeare_char CPU", "steps": args.steps, "vocab": vocab,
              "nanogpt_val_loss": NANOGPT_VAL_LOSS, "results": results}
    (out_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'attention':<10}{'val loss':>10}{'tokens/s':>12}{'train s':>10}{'process s':>11}"
          f"{'trainable':>12}{'frozen':>10}")
    for r in results:
        print(f"{r['attention']:<10}{r['final_valid_loss']:>10.4f}{r['median_tokens_per_s']:>12,.0f}"
              f"{r['train_wall_s']:>10.1f}{r['process_wall_s']:>11.1f}{r['trainable_params']:>12,}{r['frozen_params']:>10,}")
    print(f"nanoGPT reference: val loss {NANOGPT_VAL_LOSS} (68 s wall, same machine class)")
    print(f"results: {out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
