"""Whether a process recorded in a file (a run's lock, a preparation's temporary folder) may still be running."""

import os
import socket


def process_alive(pid: int, host: str | None = None) -> bool:
    """Whether process ``pid`` of ``host`` (default: this one) may run: always on another host, whose processes
    cannot be seen from here; here, unless it has ended (another user's live process counts as running)."""
    if host is not None and host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
