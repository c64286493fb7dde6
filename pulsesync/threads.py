"""One process-wide thread pool for CPU work that releases the GIL (torch, numpy, zstd, hashing), and
the event loop thread behind the blocking publishers."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def default_threads() -> int:
    """Worker threads to use: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(default_threads(), thread_name_prefix="pulsesync")
        return _pool


def parallel_map(fn: Callable[[T], R], items: Iterable[T], threads: int | None = None) -> Generator[R, None, None]:
    """Map fn over items in order; inline when threads == 1, else on the shared pool.

    Tasks must not call parallel_map themselves (the pool is bounded, nesting could deadlock).
    """
    if threads == 1:
        return (fn(item) for item in items)
    if threads is None or threads == default_threads():
        return _in_order(_shared_pool(), fn, items)
    # An explicit, different width: a short-lived pool of exactly that size.
    with ThreadPoolExecutor(threads, thread_name_prefix="pulsesync") as pool:
        return (result for result in list(_in_order(pool, fn, items)))


def _in_order(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T]) -> Generator[R, None, None]:
    futures: list[Future[R]] = []
    try:
        for item in items:  # (items may be made as they are submitted: one that fails still waits for the others)
            futures.append(pool.submit(fn, item))
        for future in futures:
            yield future.result()
    finally:
        # On an error (or an early close) no task may still be running when the caller moves on:
        # tasks write into shared state, and the caller's rollback must come after the last write.
        for future in futures:
            future.cancel()
        wait(futures)


class Runner:
    """Tasks submitted one by one while the caller makes the next: threads - 1 workers run them, and the
    caller itself runs, newest first, those no worker has started once it has submitted the last
    (run_one). All inline when threads == 1.

    threads workers beside a busy caller would be threads + 1 threads on threads cores: on 2 cores
    the caller, which parses and decompresses what the workers apply, ran a third of the time late.
    """

    def __init__(self, threads: int | None) -> None:
        self._own: ThreadPoolExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._tasks: list[_Task[Any]] = []
        width = default_threads() if threads is None else threads
        if width == default_threads() and width > 1:
            self._pool = _side()
        elif width > 1:
            self._pool = self._own = ThreadPoolExecutor(width - 1, thread_name_prefix="pulsesync")

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        """fn(*args) on a worker, or here (its result or exception in the future returned)."""
        task = _Task(fn, args)
        if self._pool is None:
            task.run()
        else:
            self._tasks.append(task)
            self._pool.submit(task.run)
        return task.future

    def run_one(self) -> bool:
        """Run here the newest task no worker has started (the workers take the oldest first); False: none is left."""
        while self._tasks:
            if self._tasks.pop().run():
                return True
        return False

    def close(self) -> None:
        """Wait for the tasks of a pool of its own, and shut it down."""
        if self._own is not None:
            self._own.shutdown(wait=True)


class _Task(Generic[R]):
    """fn(*args), run once by whichever thread claims it first: a worker, or the caller."""

    def __init__(self, fn: Callable[..., R], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.future: Future[R] = Future()
        self._claimed = threading.Lock()

    def run(self) -> bool:
        """Run it, unless another thread has (its result or exception in the future); whether this call ran it."""
        if not self._claimed.acquire(blocking=False):
            return False
        try:
            self.future.set_result(self.fn(*self.args))
        except BaseException as e:  # as a pool's future holds it
            self.future.set_exception(e)
        return True


_side_pool: ThreadPoolExecutor | None = None


def submit_beside(fn: Callable[..., R], *args: Any) -> Future[R]:
    """Run fn(*args) on a pool of (CPUs - 1) threads, leaving a core to the caller's own loop.

    For work that overlaps a single-threaded caller (hashing tensors while records decode): on
    2 cores, a second hashing thread only steals the decoder's core.
    """
    return _side().submit(fn, *args)


def _side() -> ThreadPoolExecutor:
    global _side_pool
    with _lock:
        if _side_pool is None:
            _side_pool = ThreadPoolExecutor(max(1, default_threads() - 1), thread_name_prefix="pulsesync-side")
        return _side_pool


async def in_thread_to_completion(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """asyncio.to_thread, except that a cancelled caller still waits for the thread to finish.

    For work that writes into memory or files the caller cleans up on failure: cleaning up while
    the thread still writes would race it.
    """
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


class LoopThread:
    """An asyncio event loop on a daemon thread of its own, for blocking code that drives async code."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the loop; block until it returns (or raises)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    @property
    def closed(self) -> bool:
        """Whether the loop was stopped."""
        return self.loop.is_closed()

    def stop(self) -> None:
        """Stop the loop and join its thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
