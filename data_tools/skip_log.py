"""Records a build skips: counted by reason and file, with a few file:line examples for the
manifest; under --strict the first one stops the build instead."""

from collections import Counter, defaultdict

from data_tools.readers import DataError

MAX_SKIP_EXAMPLES = 5  # file:line examples kept per reason


def bad_record_error(path: str, line: int, reason: str, detail: str) -> DataError:
    return DataError(f"{path}:{line}: {reason}: {detail}")


class SkipLog:
    """Skipped records by reason and file, with a few file:line examples; raises under strict."""

    def __init__(self, strict: bool, report):
        self.strict = strict
        self.report = report
        self.by_reason = Counter()
        self.by_file = defaultdict(Counter)
        self.examples = defaultdict(list)

    def add(self, path: str, line: int, reason: str, detail: str) -> None:
        if self.strict:
            raise bad_record_error(path, line, reason, detail)
        where = f"{path}:{line}"
        self.by_reason[reason] += 1
        self.by_file[path][reason] += 1
        if len(self.examples[reason]) < MAX_SKIP_EXAMPLES:
            self.examples[reason].append(f"{where}: {detail}")
            self.report(f"skipped {reason} at {where}: {detail}")

    def summary(self) -> dict:
        return {
            "total": sum(self.by_reason.values()),
            "by_reason": dict(self.by_reason),
            "by_file": {path: dict(reasons) for path, reasons in self.by_file.items()},
            "examples": dict(self.examples),
        }
