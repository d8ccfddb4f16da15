"""Counting the torch ops a piece of code dispatches (the exchange tests' "one call per
bucket" checks)."""

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """Within ``with CountOps() as mode:``, ``mode.counts`` maps each dispatched op's packet
    name ("accordion.topk_ef_many", "aten.mm", ...) to how many times it ran."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key = str(func.overloadpacket)
        self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))
