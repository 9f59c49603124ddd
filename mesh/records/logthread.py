"""The run directory's logging thread: writes the training loop should not wait for.

A recorded step's rows are built, encoded and appended here, one job after another in the
order they were sent, while the loop goes on to the next step. A job that fails (a full
disk) does not interrupt the step it was sent from: its error is kept, the jobs sent after
it are skipped, and the loop's next ``submit`` (or ``drain``) raises it, where a write the
loop made itself would have raised.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

Job = Callable[[], None]


class LogThread:
    def __init__(self, name: str = "run-logging"):
        self._jobs: queue.SimpleQueue[Job | threading.Event | None] = queue.SimpleQueue()  # Event: a drain
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Run ``job`` on the thread after the jobs sent before it; first raises the error of a job
        that failed since the last call (the jobs after a failed one are skipped)."""
        self._raise()
        self._jobs.put(job)

    def drain(self) -> None:
        """Wait until every job sent so far has run; raises the first failure among them."""
        done = threading.Event()
        self._jobs.put(done)
        done.wait()
        self._raise()

    def close(self) -> BaseException | None:
        """Run what is left, stop the thread and return the failure it kept, if any (never raises:
        this runs at a run's end, after a failure too)."""
        self._jobs.put(None)
        self._thread.join()
        error, self._error = self._error, None
        return error

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()
                continue
            if self._error is not None:  # skipped after a failure
                continue
            try:
                job()
            except BaseException as error:  # kept for the loop, which decides what it means
                self._error = error
