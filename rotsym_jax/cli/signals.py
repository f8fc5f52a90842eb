"""How the `rotsym` command stops on SIGINT (Ctrl-C), SIGTERM and SIGHUP: one line on stderr, the
temporary files and folders this process made removed and its output lock released
(`owned.remove_registered`), exit 128 + the signal's number (130, 143, 129).

No exception is raised into the running code: a KeyboardInterrupt unwinding through XLA's C++
frames (a signal landing during compilation) crashed the process (SIGSEGV), and one landing between
a folder's `mkdir` and the `try` that removes it left the folder behind. Instead Python's signal
handler only records the signal (C-level: it writes the signal's number to a pipe, `set_wakeup_fd`),
and a thread reading that pipe does the rest at once, whatever the main thread is doing (even inside
a long compilation): it waits for a folder being published (`owned.critical`), removes what is
registered, prints the line and ends the process with `os._exit` (no unwinding, no atexit). When the
main thread next runs Python, the handler parks it (unless it is publishing) so that it neither prints
a traceback nor finishes while the cleanup runs.

Only the command line installs this (for the duration of `main`, the previous handlers restored
after); the library changes no signal state.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from .. import owned

SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None)
_received = threading.Event()


def _park(signum, frame) -> None:
    """Python's handler, in the main thread: record the signal; unless the main thread is publishing
    a folder (the cleanup waits for it), wait here for the watcher to end the process."""
    _received.set()
    if owned.in_critical(threading.get_ident()):
        return
    threading.Event().wait(60)  # the watcher ends the process long before; should it not, end it here
    os._exit(128 + signum)


def wait_if_stopping() -> None:
    """For an error in the main thread: where a signal was received, the error may be the cleanup's
    doing (a file it closed or removed under a writer: EBADF), and the watcher is ending the
    process with its one line; wait for it instead of printing a second line."""
    if _received.is_set():
        threading.Event().wait(60)
        os._exit(1)


def _stop(prog: str, signum: int, since: int) -> None:
    """Remove what this process registered, say so in one line, and end the process (whatever
    happens on the way: never a traceback, never a process left running). The registry's lock is
    taken and never given back: nothing is published after the cleanup began."""
    line = f"{prog}: interrupted ({signal.Signals(signum).name})"
    with contextlib.suppress(BaseException):
        owned.critical().__enter__()  # held until the process ends
        outputs, published, failed = owned.remove_registered(since)
        if published:
            line += f" after writing {', '.join(map(str, published))}"
        else:
            line += "; nothing was written" + (f", {', '.join(map(str, outputs))} untouched" if outputs else "")
        if failed:
            line += f"; could not remove {', '.join(map(str, failed))}"
    with contextlib.suppress(BaseException):
        os.write(2, (line + "\n").encode(errors="replace"))
    os._exit(128 + signum)


def _watch(read_fd: int, prog: str, since: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data or 0 in data:  # closed, or told to stop
            return
        for signum in data:
            if signum in SIGNALS:
                _received.set()
                _stop(prog, signum, since)


@contextlib.contextmanager
def handled(prog: str) -> Iterator[None]:
    """Run the block with SIGINT, SIGTERM and SIGHUP handled as this module says; `prog` names the
    command in the line printed ("rotsym align"). Off the main thread (where Python cannot install
    handlers), the block runs as it is."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "set_wakeup_fd"):
        yield
        return
    _received.clear()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    watcher = threading.Thread(target=_watch, args=(read_fd, prog, owned.published_count()), name="rotsym-signals", daemon=True)
    watcher.start()
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous = {s: signal.signal(s, _park) for s in SIGNALS}
    try:
        yield
    finally:
        if _received.is_set():  # the watcher is ending the process: never return past it
            threading.Event().wait()
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        signal.set_wakeup_fd(previous_fd)
        with contextlib.suppress(OSError):
            os.write(write_fd, b"\0")
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)
