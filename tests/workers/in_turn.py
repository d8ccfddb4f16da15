"""Run one worker script several times in one launch, one argument set after another:

    in_turn.py SCRIPT "ARGS OF RUN 1" "ARGS OF RUN 2" ...

Each run executes SCRIPT afresh (``runpy``: new globals) in this same process, so a job of
several runs pays the launcher's start-up, the imports (torch, Horovod) and the rendezvous
once instead of once per run: most of a short check's time on this project's 2-core CI
machine. After a run returns, every rank prints ``in_turn: done ARGS``; a failed check exits
the process (``worker_util.checker``), and with it the runs after it, which then have no such
line (a script's ``sys.exit(0)`` ends its run, not the job). Only for scripts that can run
twice in one process: Horovod's ``hvd.init()`` is a no-op the second time, each run builds its
own model, optimizer and compressor, and none patches anything a later run relies on (the
test modules order their argument sets where one does: see test_compressor_horovod.py).
"""

import runpy
import shlex
import sys
from pathlib import Path

from worker_util import say

script = str(Path(__file__).resolve().parent / sys.argv[1])
for args in sys.argv[2:]:
    sys.argv = [script, *shlex.split(args)]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # a script that ends early on success (sys.exit(0)) goes on to the next run
        if exc.code not in (0, None):
            raise
    say(f"in_turn: done {args}")
