"""A sandbox for untrusted, model-written code: ``run`` one program, ``run_many`` several at once.

::

    from workers.sandbox import run, run_many, Sandbox, SandboxLimits

    run("print(6 * 7)").stdout                         # "42\\n"
    run("while True: pass", timeout=1).status           # "timeout"
    run_many(["print(1)", "print(2)"], max_workers=4)   # results in the programs' order

- ``limits``: ``SandboxLimits`` (timeout, memory, processes, file size,
  output, open files, disk) and how each is enforced;
- ``result``: ``SandboxResult`` and the statuses (``STATUSES``);
- ``isolation``: the levels (bwrap, unshare, limits-only), which one runs here,
  what each covers, and the command line of each;
- ``cgroup``: a cgroup leaf per program (its whole memory and process count;
  every process killed at the end);
- ``reaper``: the first process of a limits-only program without a leaf;
- ``runner``: ``run``;
- ``pool``: ``run_many`` and ``Sandbox`` (a bounded pool, with ``async arun``);
- ``config``: a job's ``sandbox`` section and its check before launch.

``hybridflow.sandbox`` re-exports the public names.
"""

from workers.sandbox.config import SANDBOX_REWARDS, SANDBOX_TOOLS, SandboxConfig, isolation_problem
from workers.sandbox.isolation import (
    AUTO,
    LEVELS,
    LIMITS_ONLY,
    available_levels,
    isolation_level,
    level_facts,
    set_default_isolation,
)
from workers.sandbox.limits import SandboxLimits
from workers.sandbox.pool import Sandbox, run_many
from workers.sandbox.result import STATUSES, SandboxResult
from workers.sandbox.runner import LANGUAGES, run

__all__ = ["AUTO", "LANGUAGES", "LEVELS", "LIMITS_ONLY", "SANDBOX_REWARDS", "SANDBOX_TOOLS", "STATUSES", "Sandbox",
           "SandboxConfig", "SandboxLimits", "SandboxResult", "available_levels", "isolation_level",
           "isolation_problem", "level_facts", "run", "run_many", "set_default_isolation"]
