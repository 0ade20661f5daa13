"""Where a sweep's runs execute: a local process pool (the default) or a Ray cluster (``--ray``).

Both take the same jobs: a module-level function and a list of argument tuples, each job independent and
writing its own files. Results never depend on the executor, the number of workers or the completion order:
each job's output is a function of its arguments alone (the runs set one torch thread each and seed
everything from their config).

Ray is an optional extra (``pip install 'detrl[ray]'``). On a cluster of several machines, the sweep's
output directory must be on a filesystem every node sees (NFS, a mounted bucket): jobs write their bundles
there, and the driver reads them back to summarise.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.forkserver
from collections.abc import Callable, Sequence
from typing import Any

#: What every job here imports: a session (torch, the engine) and torch's dynamo, which each torch optimizer
#: imports when it is built (1.3 s of a fresh process here). The local workers' parent imports them once,
#: after :mod:`detrl.run.worker_signals` (a Ctrl-C while it imports ends it quietly).
PRELOAD = ("detrl.run.worker_signals", "detrl.run.sessions", "torch._dynamo")


def _start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def prestart() -> None:
    """Start the process local workers fork from (a fresh Python importing :data:`PRELOAD`), now, so that it
    imports while this process goes on with its own imports and checks; :func:`run_local` then forks workers
    that start with torch and the engine imported. Calling it again does nothing; :func:`run_local` calls it
    when nobody did. Where ``forkserver`` does not exist (Windows), workers are spawned and each imports."""
    if _start_method() == "forkserver":
        multiprocessing.set_forkserver_preload(list(PRELOAD))
        multiprocessing.forkserver.ensure_running()


class JobFailed(RuntimeError):
    """A job raised: the message names the job and says what went wrong, in one line."""


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}".rstrip(": ")


def run_local(
    fn: Callable[..., Any],
    jobs: Sequence[tuple[Any, ...]],
    workers: int,
    on_done: Callable[[int, Any], None],
    names: Sequence[str] | None = None,
) -> None:
    """Run ``fn(*jobs[i])`` for every ``i`` in a pool of ``workers`` processes and call ``on_done(i, result)``
    in this process as each finishes. The first failure cancels what has not started and raises
    :class:`JobFailed`.

    The workers are forked from a fresh process that only imported modules (:func:`prestart`): none inherits
    state from this one, such as torch's thread pool or an RNG, as with ``spawn``, but none pays the imports.
    """
    prestart()
    ctx = multiprocessing.get_context(_start_method())
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(fn, *job): i for i, job in enumerate(jobs)}
        try:
            for fut in concurrent.futures.as_completed(futures):
                i = futures[fut]
                try:
                    result = fut.result()
                except concurrent.futures.process.BrokenProcessPool:
                    raise JobFailed("a worker process died (killed, or out of memory)") from None
                except Exception as e:
                    where = names[i] if names else f"job {i}"
                    raise JobFailed(f"{where} failed: {_one_line(e)}") from None
                on_done(i, result)
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def run_ray(
    fn: Callable[..., Any],
    jobs: Sequence[tuple[Any, ...]],
    address: str,
    workers: int,
    on_done: Callable[[int, Any], None],
    names: Sequence[str] | None = None,
) -> None:
    """Run the jobs as Ray tasks (one CPU each) and call ``on_done(i, result)`` as each finishes.

    ``address``: ``auto`` connects to the Ray cluster running on this machine (``ray start``) or, when there
    is none, starts a local instance with ``workers`` CPUs; ``local`` always starts one; anything else is a
    cluster address (``ray://host:10001`` or ``host:6379``). A Ray instance started here is shut down at the
    end; a cluster we connected to is left running. Ray's own scheduler places the tasks; Ctrl-C cancels
    those still pending.
    """
    try:
        import ray
    except ImportError:
        raise JobFailed("--ray needs Ray: pip install 'detrl[ray]'") from None
    started = not ray.is_initialized()
    if started:
        if address == "local":
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        elif address == "auto":
            try:
                ray.init(address="auto", log_to_driver=False)
            except ConnectionError:
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        else:
            try:
                ray.init(address=address, log_to_driver=False)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - Ray exits (SystemExit) when no GCS answers
                why = "no Ray cluster answered there" if isinstance(e, SystemExit) else _one_line(e)
                raise JobFailed(f"--ray {address}: cannot connect: {why}") from None
    try:
        # One CPU per task: each run uses one torch thread, so Ray packs one run per core.
        remote = ray.remote(num_cpus=1, max_retries=0)(fn)
        pending = {remote.remote(*job): i for i, job in enumerate(jobs)}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                i = pending.pop(done[0])
                try:
                    result = ray.get(done[0])
                except ray.exceptions.RayTaskError as e:
                    where = names[i] if names else f"job {i}"
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    raise JobFailed(f"{where} failed: {_one_line(cause)}") from None
                except ray.exceptions.RayError as e:
                    raise JobFailed(f"a Ray worker was lost: {_one_line(e)}") from None
                on_done(i, result)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
    finally:
        if started:
            ray.shutdown()
