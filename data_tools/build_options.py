"""The options of a shard build (`build_shards.build`), checked when they are made.

Field names are the command line's flags (`max_shard_tokens` is `--max-shard-tokens`) and the
keys of the manifest's "options".
"""

import dataclasses
import math
import os

from data_tools.manifest import SPLITS
from data_tools.readers import ReaderOptions
from data_tools.split_plan import SPLIT_MODES

# options that change shard contents; a rerun reuses shards only if these are unchanged
CONTENT_OPTIONS = (
    "text_key",
    "txt_mode",
    "source_name",
    "hf_split",
    "hf_config",
    "split",
    "split_mode",
    "split_by_source",
    "max_shard_tokens",
    "seed",
)


class BuildOptionError(ValueError):
    """An option value a build cannot run with; the message names the option."""


def _available_cpus() -> int:
    """The CPUs this process may use."""
    return len(os.sched_getaffinity(0))


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    input: list[str]  # files, directories, globs or hf:NAME_OR_PATH, read in order
    tokenizer: str  # sentencepiece .model
    output_dir: str  # where shards, manifest.json and build_stats.json are written
    workers: int = dataclasses.field(default_factory=_available_cpus)  # tokenizer processes
    split_by_source: bool = False  # one dataset family per source set, else one family "all"
    split: tuple[float, float, float] | None = None  # train/valid/test fractions; None: all train
    split_mode: str = "documents"  # documents: seeded hash of file:line; contiguous: by position
    seed: int = 1234  # seed of the documents split
    max_shard_tokens: int = 1_000_000_000  # a shard closes before passing this (unless 1 document)
    strict: bool = False  # stop at the first bad record, leaving no output
    weights: dict[str, float] | None = None  # blend weight per source; None: token share
    quiet: bool = False  # no progress bar
    text_key: str = ReaderOptions.text_key  # field holding the document text
    txt_mode: str = ReaderOptions.txt_mode  # how .txt files split into documents
    source_name: str | None = ReaderOptions.source_name  # source of records without meta
    hf_split: str = ReaderOptions.hf_split  # split of hf:NAME inputs
    hf_config: str | None = ReaderOptions.hf_config  # configuration name of hf:NAME inputs

    def __post_init__(self):
        if self.workers < 1:
            raise BuildOptionError("--workers must be >= 1")
        if self.max_shard_tokens < 1:
            raise BuildOptionError("--max-shard-tokens must be >= 1")
        if self.weights is not None and not self.split_by_source:
            raise BuildOptionError("--weights needs --split-by-source")
        if self.weights is not None and min(self.weights.values(), default=0) < 0:
            raise BuildOptionError("--weights must be >= 0")
        if self.split_mode not in SPLIT_MODES:
            raise BuildOptionError(f"--split-mode must be one of {', '.join(SPLIT_MODES)}")
        if self.split is not None and not _are_fractions(self.split):
            raise BuildOptionError(
                f"--split must be {len(SPLITS)} fractions ({', '.join(SPLITS)}) >= 0 summing to 1"
            )


def _are_fractions(split) -> bool:
    return len(split) == len(SPLITS) and min(split) >= 0 and math.isclose(sum(split), 1.0)
