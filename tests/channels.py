"""A test's own channel around another (counting, corrupting, checking what crosses it):
``Forwarding`` hands every call of the channel contract (accordion_hvd/comm/channel.py) to the
channel inside, and any other attribute too; a test overrides what it watches."""

from accordion_hvd.comm.channel import Channel


class Forwarding(Channel):
    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):  # rank, size, timeout, timings, ...: the inner channel's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def allreduce_mean_async(self, tensors, name):
        return self.inner.allreduce_mean_async(tensors, name)

    def allgather_async(self, tensor, name):
        return self.inner.allgather_async(tensor, name)

    def wait(self, handle):
        return self.inner.wait(handle)

    def test(self, handle):
        return self.inner.test(handle)

    def lane(self, name):
        return self.inner.lane(name)

    def control_plane(self):
        return self.inner.control_plane()

    def note_step(self, step):
        self.inner.note_step(step)

    def forget_handles(self):
        self.inner.forget_handles()

    def close(self):
        self.inner.close()
