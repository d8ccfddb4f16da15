"""Nothing may hang: ranks that disagree fail with a message naming what differs, within a
timeout. Under real horovodrun (Gloo and MPI) and on the simulated world."""

import re
import threading
import time

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.comm.channel import DEFAULT_TIMEOUT, TIMEOUT_ENV, Channel, collective_timeout
from launch import horovodrun

CONFIG_ERROR = "ValueError: AccordionCompressor: ranks were started with different settings"


# --- under horovodrun -----------------------------------------------------------------------
def run_mismatch(mode, backend, **env):
    start = time.monotonic()
    result = horovodrun(["tests/workers/mismatch_check.py", mode], np=2, backend=backend, timeout=120, env=env)
    return result, time.monotonic() - start


def messages_by_rank(out):
    """{rank: message} from the "rank R: ..." lines the workers print (launcher prefixes removed)."""
    # Launchers tag every line ("[0]<stdout>:", mpirun's "[1,0]<stdout>:"), and mpirun may
    # glue another rank's tag to the end of a line: drop the tags wherever they are.
    plain = re.sub(r"\[[\d,]+\]<std(?:out|err)>:", "", out)
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^rank (\d+): (.*)$", plain, re.M)}


@pytest.mark.horovod
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("mode,fields", [
    ("rank", ["'rank': 2 (process 0) vs 4 (process 1)", "'critical_rank': 2 (process 0) vs 4 (process 1)"]),
    ("codec", ["'codec': 'powersgd' (process 0) vs 'topk' (process 1)", "'ratio': (not set) (process 0) vs 0.1 (process 1)"]),
    ("ratio", ["'ratio': 0.05 (process 0) vs 0.1 (process 1)"]),
    ("eta", ["'eta': 0.5 (process 0) vs 0.3 (process 1)"]),
    ("policy", ["'policy'"]),
    ("interval", ["'interval': 100 (process 0) vs None (process 1)"]),
])
def test_different_settings_fail_with_the_same_message_on_every_rank(mode, fields, backend):
    result, elapsed = run_mismatch(mode, backend)
    assert result.returncode != 0, result.stdout
    messages = messages_by_rank(result.stdout)
    assert sorted(messages) == [0, 1], result.stdout  # every rank raised, none hung or went on
    assert messages[0] == messages[1], result.stdout
    assert messages[0].startswith(CONFIG_ERROR), result.stdout
    for field in fields:
        assert field in messages[0], result.stdout
    assert elapsed < 60, f"took {elapsed:.0f} s"


@pytest.mark.horovod
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("mode,message,layer", [
    ("layers", "ranks compress different layers", "'extra.weight': shape [32, 32] on rank 0 vs not compressed on rank 1"),
    ("dense-layers", "ranks have different uncompressed layers",
     "'extra': shape [32] on rank 0 vs no uncompressed layer of that name on rank 1"),
])
def test_a_layer_only_one_rank_has_fails_on_every_rank_naming_it(backend, mode, message, layer):
    # Rank 0 has a layer that rank 1 lacks: a compressed weight, or an uncompressed bias (which
    # the compressor averages in its own dense round). At the end of the first step the ranks
    # agree on each round's layers (accordion_hvd/exchange/buckets.py): every rank raises the
    # same ValueError naming the layer, instead of pairing the wrong collectives or hanging.
    result, elapsed = run_mismatch(mode, backend, **{TIMEOUT_ENV: "5"})
    assert result.returncode != 0, result.stdout
    messages = messages_by_rank(result.stdout)
    assert sorted(messages) == [0, 1], result.stdout
    assert messages[0] == messages[1], result.stdout
    assert messages[0].startswith(f"ValueError: AccordionCompressor: {message}"), result.stdout
    assert layer in messages[0], result.stdout
    assert elapsed < 60, f"took {elapsed:.0f} s"


@pytest.mark.horovod
def test_ranks_that_start_from_different_parameters_are_named_naming_the_broadcast():
    # A Horovod user who forgets hvd.broadcast_parameters would train diverging replicas with
    # no word: the first step's settings agreement compares a digest of the parameters, and
    # every rank warns (Horovod allows it: its own tests train so; an error would break them).
    result, elapsed = run_mismatch("parameters", "gloo")
    assert result.returncode == 0, result.stdout
    assert messages_by_rank(result.stdout) == {0: "no error", 1: "no error"}, result.stdout
    for rank in (0, 1):
        warned = [line for line in result.stdout.splitlines() if line.startswith(f"[{rank}]<stderr>:")
                  and "the model's parameters differ across ranks at the first step" in line]
        assert len(warned) == 1, result.stdout
        assert "(process 0) vs" in warned[0] and "hvd.broadcast_parameters(model.state_dict(), root_rank=0)" \
            in warned[0], result.stdout
    assert elapsed < 60, f"took {elapsed:.0f} s"


@pytest.mark.horovod
def test_a_codec_passed_as_compression_says_to_wrap_it_on_every_rank():
    result, elapsed = run_mismatch("codec-as-compression", "gloo")
    assert result.returncode != 0, result.stdout
    messages = messages_by_rank(result.stdout)
    assert sorted(messages) == [0, 1] and messages[0] == messages[1], result.stdout
    assert messages[0] == ("TypeError: PowerSGD is a codec, not a Horovod compressor: pass compression="
                           "acc.AccordionCompressor(acc.PowerSGD(...)) to hvd.DistributedOptimizer"), result.stdout
    assert elapsed < 60, f"took {elapsed:.0f} s"


# --- on the simulated world ----------------------------------------------------------------
def first_step_errors(world_size, make_codec, args=lambda rank: {}):
    """Every simulated rank compresses one layer; returns each rank's error message (or None)."""
    def worker(rank, channel):
        comp = acc.AccordionCompressor(make_codec(rank), channel=channel, **args(rank))
        try:
            comp.compress_named("fc.weight", torch.randn(40, 64))
        except ValueError as exc:
            return str(exc)
    return SimulatedWorld(world_size, timeout=10).run(worker)


def test_simulated_different_rank_raises_the_same_error_on_every_rank():
    errors = first_step_errors(3, lambda r: acc.PowerSGD(rank=4 if r == 1 else 2))
    assert errors[0] == errors[1] == errors[2]
    assert errors[0] == (
        "AccordionCompressor: ranks were started with different settings; every process must create "
        "AccordionCompressor with the same arguments. Differing (process N is the job's rank N): 'critical_rank': 2 (processes 0, 2) "
        "vs 4 (process 1); 'rank': 2 (processes 0, 2) vs 4 (process 1).")


def test_simulated_different_codec_eta_and_interval_are_named():
    errors = first_step_errors(2, lambda r: acc.PowerSGD(rank=2) if r == 0 else acc.TopK(ratio=0.1),
                               args=lambda r: {"eta": 0.5 + r, "interval": 100 * (r + 1)})
    assert errors[0] == errors[1]
    for field in ["'codec': 'powersgd' (process 0) vs 'topk' (process 1)", "'eta': 0.5 (process 0) vs 1.5 (process 1)",
                  "'interval': 100 (process 0) vs 200 (process 1)", "'rank': 2 (process 0) vs (not set) (process 1)"]:
        assert field in errors[0]
    assert "min_compression_rate" not in errors[0]  # equal on both ranks


class CountingChannel(Channel):
    """Wraps a channel, recording the name of every collective issued."""
    def __init__(self, inner):
        self.inner, self.names = inner, []
        self.rank, self.size, self.timeout = inner.rank, inner.size, inner.timeout

    def allreduce_mean_async(self, tensors, name):
        self.names.append(name)
        return self.inner.allreduce_mean_async(tensors, name)

    def control_plane(self):
        return self.inner.control_plane()

    def allgather_async(self, tensor, name):
        self.names.append(name)
        return self.inner.allgather_async(tensor, name)

    def wait(self, handle):
        return self.inner.wait(handle)


def test_simulated_equal_settings_are_checked_once_at_the_first_compress():
    def worker(rank, channel):
        channel = CountingChannel(channel)
        comp = acc.AccordionCompressor(acc.PowerSGD(rank=2), channel=channel)
        for step in range(3):
            sent = {n: comp.compress_named(n, torch.randn(40, 64)) for n in ("w1", "w2")}
            for n, (tensor, ctx) in sent.items():
                comp.decompress(tensor, ctx)
        return channel.names
    for names in SimulatedWorld(2).run(worker):
        assert names.count("acc.config") == 1 and names[0] == "acc.config", names


def test_simulated_collective_no_other_rank_submits_times_out_with_its_name():
    # Rank 1 takes part in the configuration check (a dense layer) and then stops; rank 0
    # compresses a layer and waits, in the first step, for the agreement on the compressed
    # layers that nobody joins.
    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.PowerSGD(rank=2), channel=channel)
        comp.compress_named("bias", torch.randn(40))
        if rank == 0:
            sent, ctx = comp.compress_named("fc.weight", torch.randn(40, 64))
            comp.decompress(sent, ctx)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        SimulatedWorld(2, timeout=0.5).run(worker)
    assert time.monotonic() - start < 5
    assert str(info.value) == (
        "AccordionCompressor: collective 'acc.P.layout.size' did not complete within 0.5 s on rank 0 (world size 2). "
        "Usually the ranks disagree on their configuration or on which layers get compressed (different models, "
        "or parameters that require gradients on some ranks only), so another rank never submitted "
        "'acc.P.layout.size'. If a rank is merely slow, raise ACCORDION_COLLECTIVE_TIMEOUT (seconds).")


def test_simulated_every_waiting_rank_times_out():
    # Ranks 0 and 1 wait in the configuration check; rank 2 never compresses anything.
    def worker(rank, channel):
        if rank == 2:
            return None
        comp = acc.AccordionCompressor(channel=channel)
        try:
            comp.compress_named("fc.weight", torch.randn(40, 64))
        except TimeoutError as exc:
            return str(exc)
    errors = SimulatedWorld(3, timeout=0.5).run(worker)
    for rank in (0, 1):
        assert errors[rank].startswith(f"AccordionCompressor: collective 'acc.config' did not complete within "
                                       f"0.5 s on rank {rank} (world size 3)."), errors


def test_simulated_failure_on_one_rank_is_reported_not_a_timeout():
    def worker(rank, channel):
        comp = acc.AccordionCompressor(channel=channel)
        if rank == 1:
            raise KeyError("boom")
        comp.compress_named("fc.weight", torch.randn(40, 64))
    with pytest.raises(KeyError, match="boom"):
        SimulatedWorld(2, timeout=30).run(worker)


# --- the timeout setting and the Horovod channel's wait -------------------------------------
def test_timeout_comes_from_the_argument_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout() == DEFAULT_TIMEOUT == 300
    assert collective_timeout(2) == 2.0
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert collective_timeout() == 7.5
    assert collective_timeout(2) == 2.0  # the argument wins
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="ACCORDION_COLLECTIVE_TIMEOUT must be a number of seconds, got 'soon'"):
        collective_timeout()
    monkeypatch.setenv(TIMEOUT_ENV, "0")
    with pytest.raises(ValueError, match="ACCORDION_COLLECTIVE_TIMEOUT must be a positive number of seconds, got 0.0"):
        collective_timeout()
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got -1"):
        SimulatedWorld(2, timeout=-1)
    with pytest.raises(TypeError, match="timeout must be a number of seconds, got str"):
        collective_timeout("5")


class FakeHorovod:
    """Just enough of horovod.torch for HorovodChannel: a collective completes when told to."""
    def __init__(self):
        self.done = threading.Event()

    def rank(self):
        return 1

    def size(self):
        return 4

    def allgather_async(self, tensor, name):
        return 17

    def poll(self, handle):
        return self.done.is_set()

    def synchronize(self, handle):
        assert self.done.is_set(), "synchronize would block"
        return "result"


def test_horovod_channel_wait_polls_until_done_or_the_timeout():
    pytest.importorskip("horovod.torch")
    from accordion_hvd.comm.horovod import HorovodChannel
    channel = HorovodChannel(timeout=0.3)
    channel._hvd = fake = FakeHorovod()

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"collective 'acc\.config' did not complete within 0\.3 s on rank 1 "
                                           r"\(world size 4\)"):
        channel.wait(channel.allgather_async(torch.zeros(4), name="acc.config"))
    assert 0.3 <= time.monotonic() - start < 2

    handle = channel.allgather_async(torch.zeros(4), name="acc.topk.2")
    threading.Timer(0.1, fake.done.set).start()
    assert channel.wait(handle) == "result"
