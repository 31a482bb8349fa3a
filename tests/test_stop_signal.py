"""`pdserve serve`'s stop request: a signal that arrives while the handler runs
(Ctrl-C twice, a terminal's INT and then a supervisor's TERM) must not hang the
server. A handler that took a lock (threading.Event.set) deadlocked there:
the second handler waited for the lock the first one held, and the server
ignored every signal after."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Installs the handler, then delivers SIGINT; a tracer raises SIGTERM at every line the
# outer handler call executes (its own and those of whatever it calls), so a second
# handler runs nested at each of those points. Exits 0 once both have been seen.
NESTED_SIGNALS = textwrap.dedent("""
    import signal, sys
    from cluster.cli.stop_signal import StopSignal
    stop = StopSignal().install()
    installed = signal.getsignal(signal.SIGINT)
    handler_code = getattr(installed, "__func__", installed).__code__
    nested = 0

    def depth(frame):
        n = 0
        while frame is not None:
            n += frame.f_code is handler_code
            frame = frame.f_back
        return n

    def tracer(frame, event, arg):
        global nested
        if event == "line" and depth(frame) == 1:
            nested += 1
            signal.raise_signal(signal.SIGTERM)
        return tracer

    sys.settrace(tracer)
    signal.raise_signal(signal.SIGINT)
    for _ in range(100):      # lines where the pending signals are handled
        pass
    sys.settrace(None)
    assert stop.requested and nested >= 1, (stop.requested, nested)
    print(f"stopped on {signal.Signals(stop.signum).name} after {nested} nested signals")
""")


def test_a_signal_arriving_inside_the_stop_handler_does_not_hang_it():
    proc = subprocess.run([sys.executable, "-c", NESTED_SIGNALS], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(("stopped on SIGINT after ", "stopped on SIGTERM after "))
