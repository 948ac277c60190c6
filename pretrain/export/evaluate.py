"""Downstream evaluation of an export with lm-evaluation-harness (lm-eval's own `hf` model, plain transformers).

    python -m pretrain.export.evaluate --hf DIR --tasks hellaswag,lambada_openai,arc_easy,piqa,wikitext
        (--run-dir RUN | --out FILE) [--batch-size N] [--limit N] [--device cpu|cuda]
        [--include-path DIR] [--online] [--log-samples]

DIR is an export of pretrain.export.convert_to_hf (model and tokenizer read from disk; no remote code).
With --run-dir the result is RUN/evaluations/downstream.json, the run's evaluation record: the export must
be one of RUN (its ora_export.json names the run and the checkpoint evaluated). Otherwise --out FILE.
The record: "summary" {"<task>/<metric>": value} and "higher_is_better" per metric, both as lm-eval
reports them (a filter other than "none" is appended: "<task>/<metric>/<filter>"; standard errors stay
in the details), and "details", lm-eval's whole results dict (each example's inputs and log-likelihoods
under details.samples with --log-samples). Non-finite numbers are written as null.

The Hugging Face hub stays offline unless --online: offline, the standard tasks read their datasets from
the local cache (HF_DATASETS_CACHE), and a task whose data is not there is an error naming it, before
the model is loaded. --include-path adds a directory of lm-eval task YAMLs (local data files).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from pretrain.export.export_record import read_export_record
from pretrain.job.environment import keep_offline, keep_wandb_offline
from pretrain.job.extras import needs_extra
from pretrain.run_files.run_dir import RunDir, write_text_atomic

EXIT_ERROR = 2
EVALUATION_NAME = "downstream"
STANDARD_TASKS = "hellaswag,lambada_openai,arc_easy,piqa,wikitext"


class EvaluateError(ValueError):
    """The evaluation cannot run as asked (no export, unknown task, data not available, ...)."""


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


def load_tasks(names: list[str], include_path: Optional[str], online: bool, metadata: dict) -> tuple[Any, list]:
    """lm-eval's TaskManager and each named task (or group, or tag) built, its data loaded: a task whose
    data cannot be had fails here, named, before any model is loaded.

    Indexing lm-eval's ~15,000 built-in task YAMLs takes seconds of CPU, so tasks that are all found
    under `include_path` are loaded from there alone (unless one is a group naming built-in tasks)."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata)
        if all(name in local.all_tasks for name in names):
            try:
                return local, build_tasks(local, names, include_path, online)
            except KeyError:  # a local group naming built-in tasks: they need the whole index
                pass
    manager = TaskManager(include_path=include_path, metadata=metadata)
    return manager, build_tasks(manager, names, include_path, online)


def build_tasks(manager, names: list[str], include_path: Optional[str], online: bool) -> list:
    """Each named task, group or tag of `manager`, built (its data loaded)."""
    for name in names:
        if name not in manager.all_tasks:
            where = f" or in --include-path {include_path}" if include_path else " (a local task: --include-path DIR)"
            raise EvaluateError(f"--tasks: no lm-eval task, group or tag named '{name}' in lm-eval{where}")
    built = []
    for name in names:
        try:
            loaded = manager.load(name)
        except ConnectionError as e:
            if online:
                raise EvaluateError(f"task '{name}': its data could not be fetched: {e}") from None
            raise EvaluateError(
                f"task '{name}': its data is not in the local Hugging Face cache ({e}); the hub is offline "
                "unless --online: rerun with --online on a machine with network, or pre-download the data "
                "into HF_DATASETS_CACHE") from None
        except FileNotFoundError as e:
            offline = "" if online else " (the hub is offline unless --online)"
            raise EvaluateError(f"task '{name}': its data could not be loaded{offline}: {e}") from None
        if name in loaded["groups"]:
            built.append(loaded["groups"][name])
        elif name in loaded["tasks"]:
            built.append(loaded["tasks"][name])
        else:  # a tag: the tasks it names
            built.extend(loaded["tasks"].values())
    return built


def summarize(results: dict) -> tuple[dict[str, float], dict[str, bool]]:
    """lm-eval's results → ({"<task>/<metric>": value}, {"<task>/<metric>": higher is better}) for every
    numeric metric whose direction lm-eval states (standard errors left out)."""
    summary, higher_is_better = {}, {}
    for task, metrics in results["results"].items():
        directions = results.get("higher_is_better", {}).get(task, {})
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not isinstance(directions.get(metric), bool):
                continue
            name = f"{task}/{metric}" if filter_name in ("", "none") else f"{task}/{metric}/{filter_name}"
            summary[name] = float(value)
            higher_is_better[name] = directions[metric]
    return summary, higher_is_better


def evaluate(hf_dir: Path, tasks: list[str], batch_size: int = 8, limit: Optional[int] = None,
             device: Optional[str] = None, include_path: Optional[str] = None, online: bool = False,
             log_samples: bool = False) -> dict:
    """Run lm-eval on the export in `hf_dir`; returns the evaluation record (checkpoint not set)."""
    if not (hf_dir / "config.json").is_file():
        raise EvaluateError(f"--hf {hf_dir}: not a directory written by pretrain.export.convert_to_hf (no config.json)")
    import torch

    with needs_extra("eval"):
        import lm_eval
        from lm_eval.utils import handle_non_serializable

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_args = {"pretrained": str(hf_dir), "tokenizer": str(hf_dir)}
    manager, built = load_tasks(tasks, include_path, online, metadata=dict(model_args))
    results = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=built, task_manager=manager,
                                      batch_size=batch_size, limit=limit, device=device, log_samples=log_samples)
    # Task configs hold functions and the like: lm-eval's own serializer makes them strings.
    results = finite_or_none(json.loads(json.dumps(results, default=handle_non_serializable)))
    summary, higher_is_better = summarize(results)
    return {"name": EVALUATION_NAME, "checkpoint": None, "summary": summary, "higher_is_better": higher_is_better,
            "hf": str(hf_dir.resolve()), "tasks": tasks, "limit": limit, "lm_eval_version": lm_eval.__version__,
            "details": results}


def export_checkpoint(hf_dir: Path, run_dir: Path) -> str:
    """The checkpoint of `run_dir` that the export in `hf_dir` holds, from its record."""
    record = read_export_record(hf_dir)
    if record is None:
        raise EvaluateError(f"--hf {hf_dir}: no ora_export.json, so not known to be an export of --run-dir {run_dir}; "
                            "write the result elsewhere with --out FILE")
    if Path(record.get("run_dir", "")).resolve() != run_dir.resolve():
        raise EvaluateError(f"--hf {hf_dir} is an export of {record.get('run_dir')}, not of --run-dir {run_dir}")
    return record["checkpoint"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, type=Path, help="directory written by pretrain.export.convert_to_hf")
    parser.add_argument("--tasks", default=STANDARD_TASKS,
                        help=f"comma-separated lm-eval tasks (default: {STANDARD_TASKS})")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path,
                       help="the run DIR was exported from: writes RUN/evaluations/downstream.json")
    where.add_argument("--out", type=Path, help="write the record to this JSON file instead")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--limit", type=int, help="evaluate only the first N examples of each task (a quick check)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when there is one")
    parser.add_argument("--include-path", help="directory of extra lm-eval task YAMLs (local tasks)")
    parser.add_argument("--online", action="store_true",
                        help="let the Hugging Face libraries fetch task data from the hub (default: local cache only)")
    parser.add_argument("--log-samples", action="store_true",
                        help="keep each example's inputs and log-likelihoods in the record (large for standard tasks)")
    args = parser.parse_args(argv)
    if not args.online:
        keep_offline()  # before lm-eval imports the Hugging Face libraries, which read it at import
        keep_wandb_offline("disabled")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        if not tasks:
            raise EvaluateError(f"--tasks {args.tasks!r} names no task")
        if args.batch_size < 1:
            raise EvaluateError(f"--batch-size must be at least 1, got {args.batch_size}")
        if args.limit is not None and args.limit < 1:
            raise EvaluateError(f"--limit must be at least 1, got {args.limit}")
        checkpoint = (export_checkpoint(args.hf, args.run_dir) if args.run_dir
                      else (read_export_record(args.hf) or {}).get("checkpoint"))
        record = evaluate(args.hf, tasks, args.batch_size, args.limit, args.device, args.include_path, args.online,
                          args.log_samples)
    except EvaluateError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    record["checkpoint"] = checkpoint
    if args.run_dir:
        path = RunDir(args.run_dir).write_evaluation(record)
    else:
        path = args.out
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(record, indent=1, allow_nan=False) + "\n")
    for name, value in record["summary"].items():
        print(f"{name}: {value:.6g} ({'higher' if record['higher_is_better'][name] else 'lower'} is better)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
