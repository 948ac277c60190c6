"""Run a function over a stream of tasks in worker processes, results in task order, reading
only a bounded number of tasks ahead."""

import collections
from concurrent.futures import ProcessPoolExecutor


def ordered_results(function, tasks, workers: int, initializer, initargs: tuple):
    """function over tasks, results in task order: in this process (after
    initializer(*initargs)) for one worker, else in a pool of `workers` processes, each
    initialized the same way, with at most 4 × workers tasks read ahead of the consumer.

    A consumer that stops early (an error, a strict build's first bad record) cancels the tasks
    not started and waits for the running ones. concurrent.futures rather than
    multiprocessing.Pool: Pool's terminate() kills workers that may be writing a result, and one
    killed holding the result queue's lock hangs terminate() itself (seen in CI).
    """
    if workers == 1:
        initializer(*initargs)
        yield from map(function, tasks)
        return
    with ProcessPoolExecutor(workers, initializer=initializer, initargs=initargs) as pool:
        pending = collections.deque()
        try:
            for task in tasks:
                pending.append(pool.submit(function, task))
                if len(pending) >= 4 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
