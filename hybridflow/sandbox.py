"""The sandbox for untrusted, model-written code, in one import (``workers.sandbox`` holds it).

::

    from hybridflow.sandbox import run, run_many, isolation_level

    result = run("print(sum(range(10)))")
    result.status, result.stdout, result.isolation      # ("ok", "45\\n", "bwrap")
    run("while True: pass", timeout=1).status            # "timeout"
    run_many(["print(1)", {"code": "print(input())", "stdin": "2"}], max_workers=4)

See docs/concepts/sandbox.md for the limits, the statuses and what each
isolation level covers.
"""

from workers.sandbox import (
    LANGUAGES,
    LEVELS,
    LIMITS_ONLY,
    STATUSES,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    available_levels,
    isolation_level,
    level_facts,
    run,
    run_many,
    set_default_isolation,
)

__all__ = ["LANGUAGES", "LEVELS", "LIMITS_ONLY", "STATUSES", "Sandbox", "SandboxLimits", "SandboxResult",
           "available_levels", "isolation_level", "level_facts", "run", "run_many", "set_default_isolation"]
