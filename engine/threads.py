"""Which threads get torch's OpenMP teams: the scheduler's, which runs the model's steps."""

from __future__ import annotations

import threading

import torch


def own_threads(threads: int) -> None:
    """The calling thread (the scheduler's) runs its torch operators on ``threads`` OpenMP
    threads; every thread that starts torch work after this runs them on one.

    libgomp keeps a team of worker threads for every thread that ever ran a parallel region
    with more than one thread, for as long as that thread lives. Once it manages more threads
    than the process has CPUs, no team spins between regions, and each of a decode step's
    ~1,000 small operators waits for a woken thread: a step of 8 decoding SmolLM2 sessions took
    110 ms on this thread after the model was loaded on two threads on the main thread, 52 ms
    after a load on one (bench/micro/omp_threads_bench.py; docs/BENCHMARKS.md, "OpenMP teams"). So the
    steps and the model work sent through :meth:`.scheduler.Scheduler.call` are the only ones
    with a team: the replica loads its model on one thread, and request threads (tier copies,
    imports) run on one.

    ``torch.set_num_threads`` sets the calling thread's team size and the default that a
    thread takes when it first runs torch work; this thread takes its own now, then a short
    helper thread sets that default back to one."""
    torch.set_num_threads(threads)
    torch.get_num_threads()  # this thread's own setting, taken now (torch reads it once per thread)
    set_default_threads(1)


def set_default_threads(threads: int) -> None:
    """The torch threads a thread takes when it first runs torch work, leaving the calling
    thread's own: set from a short helper thread of its own."""
    helper = threading.Thread(target=torch.set_num_threads, args=(threads,), name="kvsnap-threads")
    helper.start()
    helper.join()
