"""``whet learn --once`` that SIGKILLs itself at a named point of its Nth training step.

``python crashing_learner.py POINT N --config whet.yaml``: a real process dying with no
cleanup (no ``finally``, no flush), at one of the learner's named step points.
"""

from __future__ import annotations

import os
import signal
import sys

from whet.learner.learner import Learner
from whet.runtime.cli import main

point, nth = sys.argv[1], int(sys.argv[2])
seen = 0


def die_at_point(self: Learner, at: str) -> None:
    global seen
    if at == point:
        seen += 1
        if seen == nth:
            os.kill(os.getpid(), signal.SIGKILL)


Learner._hook = die_at_point  # type: ignore[method-assign]
sys.exit(main(["learn", "--once", *sys.argv[3:]]))
