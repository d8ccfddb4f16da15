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


# --- checkpoints know whose they are -------------------------------------------------------
import torch  # noqa: E402

import accordion_hvd as acc  # noqa: E402
from accordion_hvd.comm import SimulatedWorld  # noqa: E402


def _trained(world_size: int, make_codec, steps: int = 3, then=None):
    """Every simulated rank trains ``steps`` steps; returns each rank's (compressor, then(comp))."""
    def worker(rank, channel):
        comp = acc.AccordionCompressor(make_codec(), channel=channel, policy="static")
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * step + rank)
            sent = {n: comp.compress_named(n, torch.randn(s, generator=gen))
                    for n, s in (("w", (48, 32)), ("b", (48,)))}
            reduced = {n: channel.wait(channel.allreduce_mean_async([out], f"hvd.{n}"))[0] for n, (out, _) in sent.items()}
            for n in sent:
                comp.decompress(reduced[n], sent[n][1])
        return comp, (then(comp) if then else None)
    return SimulatedWorld(world_size).run(worker)


CODECS = {"powersgd": lambda: acc.PowerSGD(rank=2), "topk": lambda: acc.TopK(ratio=0.1)}


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_state_records_its_rank_and_another_ranks_state_is_refused_naming_both(codec):
    (c0, _), (c1, _) = _trained(2, CODECS[codec])
    s0, s1 = c0.state_dict(), c1.state_dict()
    assert (s0["rank"], s0["world_size"], s1["rank"]) == (0, 2, 1)
    mine = c1.engine.layers["w"].residual.clone()
    with pytest.raises(ValueError, match="rank 0's, loaded on rank 1") as info:
        c1.load_state_dict(s0)
    assert "gather_state_dict()" in str(info.value) and "error_feedback=False" in str(info.value)
    assert torch.equal(c1.engine.layers["w"].residual, mine)  # nothing changed
    c1.load_state_dict(s1)  # its own: fine
    assert torch.equal(c1.engine.layers["w"].residual, mine)
    c1.load_state_dict(s0, error_feedback=False)  # asked for: rank 0's shared state, zero error feedback
    assert not c1.engine.layers["w"].residual.any()


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_one_file_for_the_job_gathered_at_rank_0_gives_each_rank_its_own_error_feedback(codec):
    results = _trained(3, CODECS[codec], then=lambda comp: comp.gather_state_dict())
    world = results[0][1]
    assert world is not None and all(r[1] is None for r in results[1:])
    residuals = [comp.engine.layers["w"].residual.clone() for comp, _ in results]
    assert not torch.equal(residuals[0], residuals[1])
    for rank, (comp, _) in enumerate(results):
        comp.engine.layers["w"].residual.zero_()
        comp.load_state_dict(world)  # every rank loads the same file
        assert torch.equal(comp.engine.layers["w"].residual, residuals[rank]), rank


def test_a_state_of_another_world_size_loads_with_zero_error_feedback_and_a_warning(caplog):
    (c0, _), _ = _trained(2, CODECS["topk"])
    (d0, _), _, _ = _trained(3, CODECS["topk"])
    with caplog.at_level("WARNING", logger="accordion_hvd"):
        d0.load_state_dict(c0.state_dict())
    assert "saved by 2 ranks, this job has 3" in caplog.text
    assert not d0.engine.layers["w"].residual.any() and d0.steps == c0.steps


# --- level switches are logged; unused layers are reported as such -------------------------
_SWITCHING_JOB = """
    import logging, sys, torch
    import accordion_hvd as acc
    from accordion_hvd.comm import SimulatedWorld
    {configure}

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4), channel=channel, interval=2)
        for step in range(8):
            scale = 1.0 if step < 4 else 1.05  # norms settle: Accordion goes from critical to normal
            gen = torch.Generator().manual_seed(rank)
            grads = {{"used.weight": scale * torch.randn(64, 32, generator=gen), "unused.weight": torch.zeros(64, 32)}}
            sent = {{n: comp.compress_named(n, g) for n, g in grads.items()}}
            for n, (out, ctx) in sent.items():
                comp.decompress(out, ctx)
        return comp.stats()["layers"]

    layers = SimulatedWorld(2).run(worker)
    print("UNUSED", {{n: v["unused"] for n, v in layers[0].items()}})
"""


def test_level_switches_are_logged_once_on_rank_0_when_logging_is_not_configured():
    result = _python(_SWITCHING_JOB.format(configure=""))
    assert result.returncode == 0, result.stderr
    switches = [line for line in result.stderr.splitlines() if line.startswith("accordion_hvd.levels: after step")]
    to_normal = [line for line in switches if "to normal" in line]
    assert len(to_normal) == 1 and "1 layer to normal (used.weight)" in to_normal[0], result.stderr
    assert not any("unused.weight" in line and "to normal" in line for line in switches), switches
    said = [line for line in switches if "had no gradient on any rank" in line]
    assert len(said) == 1 and "(unused.weight)" in said[0], result.stderr
    assert "UNUSED {'unused.weight': True, 'used.weight': False}" in result.stdout, result.stdout


def test_level_switches_follow_the_applications_logging_configuration():
    quiet = _python(_SWITCHING_JOB.format(configure="logging.basicConfig(level=logging.WARNING)"))
    assert quiet.returncode == 0 and "accordion_hvd.levels" not in quiet.stderr, quiet.stderr
    loud = _python(_SWITCHING_JOB.format(configure="logging.basicConfig(level=logging.INFO, format='%(name)s|%(message)s')"))
    assert loud.returncode == 0 and loud.stderr.count("accordion_hvd.levels|after step") >= 2, loud.stderr
    silenced = _python(_SWITCHING_JOB.format(configure="logging.getLogger('accordion_hvd.levels').setLevel(logging.WARNING)"))
    assert silenced.returncode == 0 and "accordion_hvd.levels" not in silenced.stderr, silenced.stderr


def test_a_state_loaded_before_the_rank_is_known_is_checked_at_the_first_step():
    """Loaded before any world exists (no channel, no hvd.init()): checked once the data plane says
    which rank this is, at the first step's settings check: rank 1 refuses rank 0's state."""
    (c0, _), _ = _trained(2, CODECS["topk"])
    saved = c0.state_dict()

    def worker(rank, channel):
        comp = acc.AccordionCompressor(CODECS["topk"](), policy="static")  # no channel yet: no world known
        comp.load_state_dict(saved)
        comp.engine.use_planes(channel)  # what a front end's bind() does
        try:
            comp.compress_named("w", torch.randn(48, 32))
        except ValueError as exc:
            return str(exc)
        except TimeoutError:  # rank 0: rank 1 refused before the settings check (horovodrun then ends the job)
            return "timed out"
        return "accepted"

    outcomes = SimulatedWorld(2, timeout=2).run(worker)
    assert outcomes[0] == "timed out"
    assert outcomes[1].startswith("AccordionCompressor.load_state_dict: this checkpoint is rank 0's, loaded on rank 1")
