"""Guards of a step that both update paths share: a step refused inside a
CUDA graph capture, and signals held back while a step (or a store's move)
writes the state, so a Ctrl-C never leaves it partly written."""

from __future__ import annotations

import contextlib
import signal
import threading

import torch


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` (the params' device, which need
    not be the current one) is capturing a CUDA graph. No CUDA sync or query."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()


def refuse_step_capture(device: torch.device) -> None:
    """step() copies the state between host and device through its own
    streams, which a CUDA graph cannot hold: refused before anything moves."""
    if capturing(device):
        raise RuntimeError("SwapOptimizer.step() cannot be captured in a CUDA graph: it copies the state "
                           "between host and device through its own streams. Capture the forward and backward "
                           "only, and call step() outside the graph")


HANDLED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                         if hasattr(signal, name))


@contextlib.contextmanager
def signals_after_the_step():
    """Python signal handlers run between any two bytecodes: a Ctrl-C landing
    inside torch's update of a batch (Python), or inside a store's move to a
    new plan, would leave it partly written. Meanwhile the Python handlers of
    the usual signals only note the signal; once the work is done each noted
    signal is raised again for its own handler. (Handlers run on the main
    thread only: work on another thread is never interrupted.) A handler
    wrapped meanwhile (an overlapped step's wait-first wrapper, installed by
    the step itself: it keeps the handler it wraps in `.handler`) keeps its
    wrapper, around the handler it had before, unless that handler was
    already such a wrapper (wrapped at an earlier step): then that one is put
    back as it was, so wrappers never nest, step after step."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted, saved = [], {}

    def note(received, frame):
        noted.append(received)

    for signum in HANDLED_SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler):
            saved[signum] = handler
            signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            now = signal.getsignal(signum)
            if getattr(now, "handler", None) is note and type(handler) is not type(now):
                now.handler = handler
                handler = now
            signal.signal(signum, handler)
        for signum in noted:
            signal.raise_signal(signum)
