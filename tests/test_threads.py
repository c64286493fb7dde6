"""threads.Runner: tasks run once each, on a worker or on the caller once it has submitted the last."""

from __future__ import annotations

import threading

import pytest

from pulsesync.threads import Runner


def test_the_caller_runs_the_tasks_no_worker_has_started_newest_first() -> None:
    runner = Runner(2)  # one worker beside the caller
    started, release = threading.Event(), threading.Event()
    ran: list[tuple[int, int]] = []

    def task(i: int) -> int:
        if i == 0:  # holds the worker
            started.set()
            assert release.wait(10)
        ran.append((i, threading.get_ident()))
        if i == 3:
            raise ValueError("three")
        return i * i

    futures = [runner.submit(task, i) for i in range(5)]
    assert started.wait(10)
    while runner.run_one():
        pass
    here = threading.get_ident()
    assert ran == [(4, here), (3, here), (2, here), (1, here)]  # the worker takes the oldest, the caller the newest
    release.set()
    assert [futures[i].result(10) for i in (0, 1, 2, 4)] == [0, 1, 4, 16]
    with pytest.raises(ValueError, match="three"):
        futures[3].result()
    assert not runner.run_one()  # nothing runs twice
    runner.close()
    assert sorted(i for i, _ in ran) == [0, 1, 2, 3, 4]
    assert next(thread for i, thread in ran if i == 0) != here


def test_one_thread_runs_every_task_inline() -> None:
    runner = Runner(1)
    future = runner.submit(threading.get_ident)
    assert future.done() and future.result() == threading.get_ident()
