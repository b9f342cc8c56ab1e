"""Child processes that never outlive the process that started them."""
from __future__ import annotations

import ctypes
import os

# Set by the launcher in a Python child's environment: "<parent pid>:<signal>" (see arm_from_env).
PARENT_ENV = "SPECMESH_DIE_WITH_PARENT"


def _set_pdeathsig(sig: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(1, sig)   # PR_SET_PDEATHSIG


def die_with_parent(sig: int):
    """A preexec_fn: the child gets `sig` when the process that started it dies, however it
    dies (SIGKILL included), so no redis-server outlives `specmesh up` or a test run.
    Linux's PR_SET_PDEATHSIG; elsewhere nothing. It fires when the *thread* that forked
    the child ends, so children are started from a long-lived thread. Python children use
    child_env instead (a preexec_fn is unsafe in a parent with threads)."""
    parent = os.getpid()

    def preexec() -> None:
        _set_pdeathsig(sig)
        if os.getppid() != parent:   # the parent died before prctl took effect
            os._exit(1)

    return preexec


def child_env(sig: int) -> dict[str, str]:
    """Environment for a Python child (`specmesh serve ...`) that arms the same parent-death
    signal itself, first thing (arm_from_env). Without a preexec_fn, subprocess starts the
    child with vfork/posix_spawn and runs no Python and no fork handlers before exec: a
    preexec_fn forks a multithreaded parent (gRPC's threads, `specmesh soak`'s streams) and
    the child sometimes aborted (SIGABRT) before it could exec, 8 times in one soak."""
    return {PARENT_ENV: f"{os.getpid()}:{int(sig)}"}


def arm_from_env() -> None:
    """In a child started with child_env: die with the parent from now on (and exit now if it
    already died during start-up). The variable is removed, so the child's own children do
    not inherit it."""
    value = os.environ.pop(PARENT_ENV, "")
    if not value:
        return
    parent, sig = (int(part) for part in value.split(":"))
    _set_pdeathsig(sig)
    if os.getppid() != parent:
        os._exit(1)
