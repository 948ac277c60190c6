"""Sample text from an exported model with plain transformers (what a user of the export runs).

    python -m pretrain.export.generate --hf DIR --prompt "Once upon a time" [--max-new-tokens 40] [--temperature 0.8]

DIR is read from disk only (never the Hugging Face hub: a mistyped path is an error, not a download).
The prompt's tokens plus --max-new-tokens must fit the model's positions (its training sequence length).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

EXIT_CONFIG_ERROR = 2


class GenerateError(ValueError):
    """The request cannot be sampled (no export at the path, no prompt tokens, too many positions)."""


def generate(hf_dir: str, prompt: str, max_new_tokens: int = 40, temperature: float = 0.8, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(hf_dir) / "config.json").is_file():
        raise GenerateError(f"--hf {hf_dir}: not a directory written by pretrain.export.convert_to_hf (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    prompt_tokens = inputs["input_ids"].size(1)
    if prompt_tokens == 0:
        raise GenerateError(f"--prompt {prompt!r} gives no tokens: give some text to continue")
    positions = model.config.max_position_embeddings
    if prompt_tokens + max_new_tokens > positions:
        raise GenerateError(f"--prompt ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens} = "
                            f"{prompt_tokens + max_new_tokens} tokens, more than the model's {positions} positions")
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, **sampling)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="directory written by pretrain.export.convert_to_hf")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        if not args.temperature >= 0:  # also refuses nan
            raise GenerateError(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
        print(generate(args.hf, args.prompt, args.max_new_tokens, args.temperature, args.seed))
    except GenerateError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
