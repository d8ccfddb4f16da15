"""``horovodrun``, with its two build checks answered by the caller (localrun.py).

Before every launch ``horovodrun`` asks whether Horovod was built with Gloo (under ``--mpi``,
with MPI) by forking a process that imports torch and Horovod's extension: about 2 s of a
launch on this project's 2-core machines, and the test suite launches a few hundred jobs.
localrun.py asks Horovod's own checks once per process and passes the answers
here in HOROVOD_KNOWN_BUILD ("gloo,mpi"); all the rest is horovodrun's own code
(``run_commandline``, what the ``horovodrun`` script runs). The emulated cluster
(cluster.py) runs the ``horovodrun`` script itself, as a user does.

    python horovodrun_known_build.py -np 2 -H localhost:2 --gloo python train.py
"""

import os
import sys

from horovod.runner import launch

built = set(os.environ.get("HOROVOD_KNOWN_BUILD", "").split(","))
launch.gloo_built = lambda verbose=False: "gloo" in built
launch.mpi_built = lambda verbose=False: "mpi" in built

if __name__ == "__main__":
    sys.argv[0] = "horovodrun"
    sys.exit(launch.run_commandline())
