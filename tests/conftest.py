import sys
from pathlib import Path

# Let tests import their helpers (tests/launch.py) as a plain module.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_terminal_summary(terminalreporter):
    """The bad-input suite (test_bad_input.py) prints how each of its cases ended."""
    outcomes = getattr(sys.modules.get("test_bad_input"), "OUTCOMES", None)
    if not outcomes:
        return
    total = len(sys.modules["test_bad_input"].CASES)
    errors = sum(v.startswith("error") for v in outcomes.values())
    terminalreporter.section(f"bad input: {len(outcomes)} of {total} cases ended as expected: {errors} refused "
                             f"with a clear error, {len(outcomes) - errors} gave correct output")
    for name, outcome in outcomes.items():
        terminalreporter.write_line(f"{name:42s} {outcome}")
