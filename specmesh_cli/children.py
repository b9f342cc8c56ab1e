"""Child processes that never outlive the process that started them."""
from __future__ import annotations

import ctypes
import os


def die_with_parent(sig: int):
    """A preexec_fn: the child gets `sig` when the process that started it dies, however it
    dies (SIGKILL included), so no service, and no redis-server, outlives `specmesh up` or a
    test run. Linux's PR_SET_PDEATHSIG; elsewhere nothing. It fires when the *thread* that
    forked the child ends, so children are started from a long-lived thread."""
    parent = os.getpid()

    def preexec() -> None:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            return
        libc.prctl(1, sig)   # PR_SET_PDEATHSIG
        if os.getppid() != parent:   # the parent died before prctl took effect
            os._exit(1)

    return preexec
