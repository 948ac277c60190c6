"""The progress bar of a build pass."""

import sys
import time

from tqdm import tqdm

from data_tools.readers import InputFile


class Progress:
    """A tqdm bar over input bytes (rate and ETA) with docs/s, text MB/s and tokens/s."""

    def __init__(self, files: list[InputFile], description: str, enabled: bool):
        sizes = [file.size for file in files]
        self._offsets = [0]
        for size in sizes:
            self._offsets.append(self._offsets[-1] + (size or 0))
        total = None if None in sizes else self._offsets[-1]
        self._bar = tqdm(
            total=total, unit="B", unit_scale=True, desc=description, disable=not enabled,
            file=sys.stderr, dynamic_ncols=True,
        )
        self.start = time.perf_counter()
        self._last_postfix = 0.0
        self.documents = self.tokens = self.text_bytes = 0

    def write(self, message: str) -> None:
        tqdm.write(message, file=sys.stderr)

    def advance(self, file_index: int, file_bytes_read: int | None) -> None:
        if file_bytes_read is not None:
            self._bar.update(self._offsets[file_index] + file_bytes_read - self._bar.n)
        now = time.perf_counter()
        if now - self._last_postfix >= 1.0:
            self._last_postfix = now
            self._bar.set_postfix_str(self.rates(), refresh=False)

    def rates(self) -> str:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"{self.documents / seconds:,.0f} docs/s, {self.text_bytes / seconds / 1e6:.2f} MB/s, "
            f"{self.tokens / seconds:,.0f} tokens/s"
        )

    def close(self) -> None:
        self._bar.close()
