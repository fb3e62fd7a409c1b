"""Leave a distributed job without aborting in the interpreter's teardown.

Every gloo process group runs worker threads of its own (``pt_gloo_runloop``), and a finished
collective is released on that thread, a moment after ``wait()`` returned on the Python side. When
the collective's tensors are no longer referenced from Python, releasing them needs the GIL. If
the interpreter is already finalizing at that moment, CPython ends the thread with
``pthread_exit``, whose forced unwind meets a ``noexcept`` C++ destructor: ``std::terminate``,
"terminate called without an active exception", SIGABRT, and torchrun fails a job whose every
step was done and written. Seen about once in 20 runs of ``trainer.train`` on 2 loaded cores
(core dump: ``~AsyncAllgatherCoalescedWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
``pthread_exit`` on a ``pt_gloo_runloop`` thread while the main thread was in ``Py_FinalizeEx``).

``dist.destroy_process_group()`` does not end those threads: a gloo group's threads are joined
only when the last reference to the group goes, and torch keeps one past the destroy (an FSDP2
model's ``DeviceMesh`` holds its groups in ``_pg_registry``, and the DTensor sharding caches keep
the mesh). :func:`destroy_process_groups` destroys the groups, lets go of those references and
collects, so the groups' threads are joined now, while the interpreter can still give them the
GIL (torch drops a group's last reference with the GIL released).

    for step in range(start, steps):
        ...
    guard.close()
    ...
    del guard, model, optim              # or return from the function that held them
    trainer.destroy_process_groups()
"""

from __future__ import annotations

import functools
import gc
import logging
import os
from typing import Any, Callable, TypeVar

T = TypeVar("T")

log = logging.getLogger("trainer.shutdown")

# the thread names torch gives its process groups' worker threads (Linux: /proc/self/task/*/comm)
WORKER_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_nccl_watchdg", "pt_nccl_heartbt")


def worker_threads() -> int:
    """How many process-group worker threads this process still runs (0 where /proc is absent)."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        n += name.startswith(WORKER_THREADS)
    return n


def _release_mesh_groups() -> int:
    """Drop the references every live DeviceMesh keeps to its (destroyed) process groups."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return 0
    released = 0
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict) and registry:
                released += len(registry)
                registry.clear()
    return released


def destroy_process_groups() -> int:
    """Destroy every process group (as ``dist.destroy_process_group()``; nothing if none is
    initialized), let go of the references torch keeps past the destroy, and collect. Call it
    last, when the objects that held the groups (the guard, the model) are gone. Returns the
    number of process-group worker threads still running (0 when every group was released);
    logs a warning with their count otherwise. Not collective."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    left = worker_threads()
    if left:  # still referenced: an FSDP2/DTensor mesh is the one torch itself keeps
        if _release_mesh_groups():
            gc.collect()
        left = worker_threads()
    if left:
        log.warning("%d process-group worker thread(s) still running after the groups were destroyed: "
                    "something still holds a process group (the interpreter's teardown may abort if one "
                    "of them releases a collective then)", left)
    return left


def then_destroy_process_groups(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorator for a worker's or a script's main function: when it returns, its frame and what
    it held (the guard, the model) are gone; then :func:`destroy_process_groups`. Not after an
    exception (peers may be gone, and the process is failing anyway)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        result = fn(*args, **kwargs)
        destroy_process_groups()
        return result
    return run
