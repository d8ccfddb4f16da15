"""What a new user meets in the first hour, in one process: no side effect at import, levels
that make sense or a clear error, checkpoints that know whose they are, level switches
logged, unused layers reported as such."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os
    full_env = {k: v for k, v in os.environ.items() if k != "HOROVOD_CYCLE_TIME"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=full_env)


def test_importing_the_package_changes_no_environment_variable_and_no_horovod_function():
    result = _python("""
        import os
        before = dict(os.environ)
        import horovod.torch as hvd, horovod.torch.optimizer as o, horovod.torch.mpi_ops as m
        functions = (o.synchronize, o.allreduce_async_, o.grouped_allreduce_async_, m.synchronize)
        import accordion_hvd, accordion_hvd.elastic
        assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
        assert (o.synchronize, o.allreduce_async_, o.grouped_allreduce_async_, m.synchronize) == functions
        print("untouched")
    """)
    assert result.returncode == 0 and "untouched" in result.stdout, result.stderr


def test_quiet_horovod_cycle_is_explicit_keeps_the_users_value_and_refuses_after_init():
    result = _python("""
        import os
        import accordion_hvd as acc
        assert "HOROVOD_CYCLE_TIME" not in os.environ
        assert acc.quiet_horovod_cycle() and os.environ["HOROVOD_CYCLE_TIME"] == "20"
        assert acc.quiet_horovod_cycle(20)
        os.environ["HOROVOD_CYCLE_TIME"] = "5"
        assert not acc.quiet_horovod_cycle() and os.environ["HOROVOD_CYCLE_TIME"] == "5"
        try:
            acc.quiet_horovod_cycle(0)
        except ValueError as exc:
            assert "ms must be a positive number" in str(exc)
        else:
            raise AssertionError("ms=0 accepted")
        import horovod.torch as hvd
        hvd.init()  # a world of one, without a launcher
        try:
            acc.quiet_horovod_cycle()
        except RuntimeError as exc:
            assert "before hvd.init()" in str(exc)
        else:
            raise AssertionError("accepted after hvd.init()")
        print("explicit")
    """)
    assert result.returncode == 0 and "explicit" in result.stdout, result.stderr
