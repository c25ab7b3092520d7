"""The Ray actor of one rank: ``gpu.worker.Worker`` behind a class whose module imports
nothing of ours or of transformers, so that a Ray worker process can put its ``sys.path`` in
order before they load.

Ray puts the driver's current directory first on every worker's ``sys.path``. Started from a
pagedserve checkout, that directory's ``kernels/`` folder would shadow Hugging Face's
``kernels`` package, which transformers imports (and fail the worker with an ImportError).
Importing this module moves the current directory behind site-packages: Ray imports an
actor's class module before it unpickles the actor's arguments (whose classes import
transformers). In the server process the current directory is not on ``sys.path`` (the
``pagedserve`` command starts from the venv's ``bin``), so there it changes nothing.
"""

from __future__ import annotations

import os
import sys


def current_directory_last() -> None:
    """Move ``sys.path`` entries naming the current directory ('' included) to the end."""
    here = os.path.abspath(os.curdir)
    front = [p for p in sys.path if os.path.abspath(p or os.curdir) == here]
    sys.path[:] = [p for p in sys.path if p not in front] + front


current_directory_last()


class RayWorker:
    """The methods ``RayExecutor`` calls, forwarded to the rank's ``gpu.worker.Worker``."""

    def __init__(self, spec):
        from pagedserve.gpu.worker import Worker

        self.worker = Worker(spec)

    def rendezvous(self):
        return self.worker.rendezvous()

    def init(self, init_method: str):
        return self.worker.init(init_method)

    def load(self):
        return self.worker.load()

    def execute(self, scheduler_output):
        return self.worker.execute(scheduler_output)
