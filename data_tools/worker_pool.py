"""Run a function over a stream of tasks in worker processes, results in task order, reading
only a bounded number of tasks ahead."""

import multiprocessing
import threading


class _BoundedFeed:
    """An iterable for Pool.imap that lets it read at most `limit` tasks ahead of the consumer
    (imap's task thread otherwise pulls the whole input into memory)."""

    def __init__(self, tasks, limit: int):
        self._tasks = tasks
        self._slots = threading.Semaphore(limit)
        self._stopped = threading.Event()

    def __iter__(self):
        for task in self._tasks:
            while not self._slots.acquire(timeout=0.1):
                if self._stopped.is_set():
                    return
            if self._stopped.is_set():
                return
            yield task

    def consumed(self) -> None:
        self._slots.release()

    def stop(self) -> None:
        self._stopped.set()


def ordered_results(function, tasks, workers: int, initializer, initargs: tuple):
    """function over tasks, results in task order: in this process (after
    initializer(*initargs)) for one worker, else in a pool of `workers` processes, each
    initialized the same way, with bounded read-ahead."""
    if workers == 1:
        initializer(*initargs)
        yield from map(function, tasks)
        return
    feed = _BoundedFeed(tasks, limit=4 * workers)
    with multiprocessing.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        try:
            for result in pool.imap(function, feed):
                yield result
                feed.consumed()
        finally:
            feed.stop()
