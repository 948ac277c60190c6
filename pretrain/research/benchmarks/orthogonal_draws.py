"""The cost of drawing ORA's frozen Q/K per orthogonalisation method, at the paper's model shapes.

    python -m pretrain.research.benchmarks.orthogonal_draws [--presets small,base,large]
        [--methods qr,svd,householder,cayley,hadamard] [--repeats 3] [--layers N] [--json OUT] [--markdown OUT]

For each preset (its model section: layers, d_model, heads, d_k, K/V groups, joint_heads, seed) and
each method of ora_megatron.orthogonal, the time to draw the frozen Q and K weights of every layer
exactly as the model build does (`frozen_projection`, which every rank calls for the full matrix
before taking its heads), and their orthogonality error: the largest max|W_iᵀW_i − I| over every
head i, role and layer drawn, computed in fp32 on the fp32 weight (W_i: head i's d_model × d_k
projection; orthonormal columns make it 0). Hadamard's heads are also orthonormal jointly; its
dense matrix is what the build stores, while training applies the fast transform.

Times: the median over --repeats of drawing the first --layers layers' Q and K (default: all of
them), scaled by layers / --layers to the whole model when fewer are drawn (every layer draws the
same shapes; only the seed differs), which the table says. Methods take turns within every repeat,
so a drifting machine load hits all alike; one small draw per method first warms LAPACK up. The
dense methods draw in float64 on one thread (ora_megatron.orthogonal._one_thread), as the build does.

The step time of each method in training (Hadamard's structured forward and backward included) is
`compare_arms --arms vanilla,ora_qr,...,ora_hadamard`; this script measures only the draw.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ora_megatron.model_config import ModelConfig
from ora_megatron.orthogonal import METHODS, frozen_projection
from pretrain.config.run_config import load_run_config
from pretrain.paths import preset_path
from pretrain.research.benchmarks.outputs import publish, rerun_command

SCHEMA = "ora-orthogonal-draws/1"
PRESETS = ("small", "base", "large")


def preset_model(name: str) -> ModelConfig:
    path = preset_path(name)
    if path is None:
        raise SystemExit(f"no preset {name!r} in pretrain/configs/")
    return load_run_config(str(path)).model


def draw_layer(model: ModelConfig, method: str, layer: int) -> list[torch.Tensor]:
    """Layer `layer`'s frozen Q and K weights (fp32 [heads · d_k, d_model]), as RandomQKVLinear draws them."""
    return [frozen_projection("orthogonal", method, model.hidden_size, heads, model.head_dim, seed=model.seed,
                              layer=layer, role=role, joint_heads=model.attention.joint_heads)
            for role, heads in (("q", model.num_attention_heads), ("k", model.query_groups))]


def orthogonality_error(weight: torch.Tensor, d_k: int) -> float:
    """max over heads of max|W_iᵀW_i − I| in fp32, W_i = rows [i·d_k, (i+1)·d_k) of `weight`, transposed."""
    heads = weight.float().view(-1, d_k, weight.size(1))  # [heads, d_k, d_model]: W_iᵀ
    gram = heads @ heads.transpose(1, 2)  # W_iᵀ W_i, fp32
    return (gram - torch.eye(d_k)).abs().max().item()


def run(presets: list[str], methods: list[str], repeats: int, layers: int | None) -> dict:
    models = {name: preset_model(name) for name in presets}
    for method in methods:  # warm-up: LAPACK's first calls, the Hadamard matrices' construction
        frozen_projection("orthogonal", method, 64, 4, 16, seed=0, layer=1, role="q")
    times = {(name, method): [] for name in presets for method in methods}
    errors = {(name, method): 0.0 for name in presets for method in methods}
    for _ in range(repeats):
        for name, model in models.items():
            drawn = min(layers or model.num_layers, model.num_layers)
            for method in methods:
                start = time.perf_counter()
                weights = [w for layer in range(1, drawn + 1) for w in draw_layer(model, method, layer)]
                times[(name, method)].append(time.perf_counter() - start)
                errors[(name, method)] = max(errors[(name, method)],
                                             *(orthogonality_error(w, model.head_dim) for w in weights))
    rows = []
    for name, model in models.items():
        drawn = min(layers or model.num_layers, model.num_layers)
        for method in methods:
            median = statistics.median(times[(name, method)])
            rows.append({"preset": name, "layers": model.num_layers, "d_model": model.hidden_size,
                         "heads": model.num_attention_heads, "d_k": model.head_dim, "method": method,
                         "layers_drawn": drawn, "matrices_drawn": 2 * drawn,
                         "draw_s_median": median, "draw_s_all": times[(name, method)],
                         "model_draw_s": median * model.num_layers / drawn,
                         "orthogonality_error": errors[(name, method)]})
    return {"schema": SCHEMA, "repeats": repeats, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "machine": platform.platform(), "processor": platform.processor(), "rows": rows}


def markdown(report: dict) -> str:
    lines = [f"Frozen Q/K draw per method, median of {report['repeats']} (torch {report['torch']}, "
             f"{report['torch_threads']} threads; dense methods draw on one)",
             "",
             "| preset | L, d, heads, d_k | method | layers drawn | whole model draw (s) | "
             "max\\|WᵀW − I\\| (fp32) |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        drawn = f"{r['layers_drawn']} of {r['layers']}" + (" (scaled)" if r["layers_drawn"] < r["layers"] else "")
        lines.append(f"| {r['preset']} | {r['layers']}, {r['d_model']}, {r['heads']}, {r['d_k']} | {r['method']} | "
                     f"{drawn} | {r['model_draw_s']:.3f} | {r['orthogonality_error']:.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets (pretrain/configs/)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None,
                        help="draw this many layers per model and scale the time to all of them (default: all)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or args.repeats < 1 or (args.layers is not None and args.layers < 1):
        parser.error(f"unknown methods {unknown}" if unknown else "--repeats and --layers must be >= 1")
    report = run([p for p in args.presets.split(",") if p], methods, args.repeats, args.layers)
    report["command"] = rerun_command(__spec__.name, argv)
    publish(markdown(report), json.dumps(report, indent=2) + "\n", args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
