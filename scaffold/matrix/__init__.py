"""The combination matrix: every valid combination of answers, rendered, linted and checked.

    combinations (scaffold.combinations)  which combinations: enumerated, selected, sharded
    files                                 every file of a render, in memory
    lint                                  a render as rendered: ruff, residue, absent options
    runner                                render, lint and check each, `jobs` at a time
    fork                                  a check forked from a warm worker, as python -m runs
    plan                                  which checks, planned from each answer's declaration
    report                                progress lines, the summary table, JUnit XML

`scaffold matrix` is the command line over `run_matrix`.
"""

from scaffold.combinations import (
    all_combinations,
    combination_id,
    combinations,
    select,
    shard,
    spelling,
)
from scaffold.matrix.fork import DDP_PROCESSES, PRELOAD, forking_supported
from scaffold.matrix.lint import lint_problems
from scaffold.matrix.plan import Plan, declarations, plans, proving
from scaffold.matrix.report import progress_line, summary, write_junit
from scaffold.matrix.runner import (
    CHECK_SIZES,
    COMPILE_FAMILY,
    LONGEST_NAME,
    Job,
    Outcome,
    check_sizes,
    run_matrix,
    schedule,
)

__all__ = [
    "CHECK_SIZES",
    "COMPILE_FAMILY",
    "DDP_PROCESSES",
    "LONGEST_NAME",
    "PRELOAD",
    "Job",
    "Outcome",
    "Plan",
    "all_combinations",
    "check_sizes",
    "combination_id",
    "combinations",
    "declarations",
    "forking_supported",
    "lint_problems",
    "plans",
    "progress_line",
    "proving",
    "run_matrix",
    "schedule",
    "select",
    "shard",
    "spelling",
    "summary",
    "write_junit",
]
