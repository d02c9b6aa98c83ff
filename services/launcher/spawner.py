"""How ``epd up`` starts one child: ``python -m services.cli <argv>`` in its own session.

The child is SIGTERMed if the launcher dies (Linux ``PR_SET_PDEATHSIG``),
its output is drained by the launcher (``child_output.py``), and
the secrets of its environment go on an inherited pipe instead
(``services/common/secret_pipe.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

from services.common import secret_pipe, security
from services.launcher.child_output import OutputForwarder, OutputTail
from services.launcher.specs import ServiceSpec


def _death_signal() -> Callable[[], None] | None:
    """What runs in the child before exec: SIGTERM it if the launcher dies (Linux ``PR_SET_PDEATHSIG``).

    Resolved here, in the launcher: after ``fork`` in a process with threads
    (the output pumps) the child must not import or load anything.
    """
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None
    return lambda: prctl(1, signal.SIGTERM)


class ProcessSpawner:
    """Starts ``python -m services.cli <argv>`` for a spec; its output drained into ``forwarder``.

    The secrets of the child's environment (``security.SECRET_ENVS``, the launcher's own
    included) go on an inherited pipe instead (``secret_pipe``). ``command`` replaces
    ``python -m services.cli`` (tests run stand-ins).
    """

    def __init__(self, forwarder: OutputForwarder, command: tuple[str, ...] | None = None) -> None:
        self.forwarder = forwarder
        self._command = command or (sys.executable, "-m", "services.cli")

    def __call__(self, spec: ServiceSpec) -> tuple[subprocess.Popen, OutputTail]:
        """Starts ``spec`` in its own session (Ctrl-C reaches only the launcher, which stops children in order)."""
        env = {**os.environ, **spec.env}
        secrets_fd = secret_pipe.hand_over(env, security.SECRET_ENVS)
        try:
            process = subprocess.Popen(
                [*self._command, *spec.argv],
                env=env,
                pass_fds=() if secrets_fd is None else (secrets_fd,),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_death_signal(),
            )
        finally:
            if secrets_fd is not None:
                os.close(secrets_fd)  # the child holds its own copy of the read end
        assert process.stdout is not None
        return process, OutputTail(process.stdout, self.forwarder)
