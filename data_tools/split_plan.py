"""Which split (train, valid, test) each document goes to."""

import argparse
import dataclasses
import hashlib

from data_tools.manifest import SPLITS

SPLIT_MODES = ("documents", "contiguous")


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    fractions: tuple[float, float, float] | None  # train/valid/test; None: everything is train
    mode: str  # documents: hash of (file name, line); contiguous: by position within the source
    seed: int
    cuts: dict[str, tuple[int, int]] | None = None  # contiguous: first valid, first test index

    def split_of(self, file_name: str, line: int, source: str, index_in_source: int) -> str:
        if self.fractions is None:
            return "train"
        if self.mode == "documents":
            key = f"{self.seed}:{file_name}:{line}".encode()
            position = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
            first_valid = round(self.fractions[0] * 2**64)
            first_test = round((self.fractions[0] + self.fractions[1]) * 2**64)
        else:
            first_valid, first_test = self.cuts[source]
            position = index_in_source
        if position < first_valid:
            return "train"
        return "valid" if position < first_test else "test"

    def with_cuts(self, documents_per_source: dict[str, int]) -> "SplitPlan":
        """Contiguous cuts: first X% of each source's documents train, next valid, rest test."""
        train, valid, _ = self.fractions
        cuts = {
            source: (round(count * train), round(count * (train + valid)))
            for source, count in documents_per_source.items()
        }
        return SplitPlan(self.fractions, self.mode, self.seed, cuts)


def parse_split(text: str | None) -> tuple[float, float, float] | None:
    """"train=0.98,valid=0.01,test=0.01" -> normalized (train, valid, test) fractions."""
    if not text:
        return None
    shares = dict.fromkeys(SPLITS, 0.0)
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in shares or not value:
            raise argparse.ArgumentTypeError(f"--split: expected {'|'.join(SPLITS)}=FRACTION")
        shares[name.strip()] = float(value)
    total = sum(shares.values())
    if total <= 0 or min(shares.values()) < 0:
        raise argparse.ArgumentTypeError("--split: fractions must be >= 0 with a positive sum")
    return tuple(shares[name] / total for name in SPLITS)
