"""Sample text from an exported model with plain transformers (what a user of the export runs).

    python -m pretrain.generate --hf DIR --prompt "Once upon a time" [--max-new-tokens 40] [--temperature 0.8]
"""

from __future__ import annotations

import argparse
import sys

import torch


def generate(hf_dir: str, prompt: str, max_new_tokens: int = 40, temperature: float = 0.8, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, **sampling)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="directory written by pretrain.convert_to_hf")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(generate(args.hf, args.prompt, args.max_new_tokens, args.temperature, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
