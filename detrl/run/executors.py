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
from collections.abc import Callable, Sequence
from typing import Any


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
    """Run ``fn(*jobs[i])`` for every ``i`` in a pool of ``workers`` processes (``spawn``: no state inherited
    from this process, such as torch's thread pool or an RNG) and call ``on_done(i, result)`` in this process
    as each finishes. The first failure cancels what has not started and raises :class:`JobFailed`."""
    ctx = multiprocessing.get_context("spawn")
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
