"""CI's verdict on a project's checks (scaffold.check.ci_verdict): a loader check that failed on
a close call at CI's sizes is reported, not failed; a clear slowdown, or any other check's
failure, still fails. A user's own `check loader` keeps its strict verdict."""

from __future__ import annotations

from test_project import render, run

from scaffold.check import LOADER_MARGIN, ci_verdict


def loader_line(verdict: str, load_ms: float, step_ms: float) -> str:
    """A loader check's line, as checks.py prints it."""
    return (
        f"loader: {verdict}: loader alone 3,806 samples/s ({load_ms:.2f} ms a step), training step"
        f" {step_ms:.2f} ms; with real loading 3,512 samples/s, 8.1% of the time waiting for data"
        " (num_workers=0)"
    )


def test_a_close_call_is_reported_and_a_clear_slowdown_fails():
    close = "overfit: PASS: ...\n" + loader_line("FAIL", 2.09, 1.94) + "\nresume: PASS: ..."
    passed, notes = ci_verdict(close)
    assert passed and len(notes) == 1
    assert "2.09 ms a step against a 1.94 ms step" in notes[0]

    at_margin = loader_line("FAIL", LOADER_MARGIN * 10.0, 10.0)
    assert ci_verdict(at_margin)[0]
    for slow in (LOADER_MARGIN * 10.0 + 0.01, 3 * 1.94):
        assert ci_verdict(loader_line("FAIL", slow, 1.94 if slow < 10 else 10.0)) == (False, [])


def test_any_other_failure_still_fails():
    other = loader_line("FAIL", 2.09, 1.94) + "\nbatch: FAIL: example 0's loss depends on example 3"
    assert not ci_verdict(other)[0]
    crashed = ci_verdict("Traceback (most recent call last):\nRuntimeError: boom")
    assert crashed[1] == []  # no close call to excuse: the exit status stands (checks_passed)
    assert ci_verdict("loader: FAIL: a line without its figures") == (False, [])


def test_a_loader_three_times_slower_than_the_step_fails_in_ci(tmp_path):
    """A real project at CI's batch of 8 whose loading sleeps 20 ms a batch (its MLP's step takes
    a millisecond or two):
    `check loader` fails, and CI's verdict fails it too."""
    project = render(tmp_path / "slow", device="cpu")
    data = project / "src" / "slow" / "data.py"
    source = data.read_text()
    gather = "        return self.x[indices], self.y[indices]"
    assert gather in source
    source = source.replace(gather, "        __import__('time').sleep(0.02)\n" + gather)
    data.write_text(source)

    done = run(
        project, "check", "loader", "--device", "cpu", "--num-workers", "0", "--batch-size", "8"
    )
    print(done.stdout, done.stderr)

    line = next(line for line in done.stdout.splitlines() if line.startswith("loader: "))
    assert done.returncode == 1 and line.startswith("loader: FAIL: ")
    assert ci_verdict(done.stdout) == (False, [])
