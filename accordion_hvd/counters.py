"""What a compressor has sent and spent: one object, handed to the exchanges.

Per layer, cumulative: the floats it sent and those a dense allreduce would have sent, the
bytes its collectives carried per rank at its level (``codec.wire``) and the gradient's own
bytes; seconds of codec math (``compress``) and of waiting on collectives (``comm``); steps
taken (skipped ones are step_faults.py's). The engine counts what it routes; an exchange adds its own seconds, and
a per-step policy's correction of what a layer sent (TopK's exchange). ``load`` changes the
dicts in place, so an exchange built before a checkpoint was loaded counts on into them.
"""

from __future__ import annotations

from typing import Any


class Counters:
    def __init__(self) -> None:
        self.sent: dict[str, int] = {}         # floats sent, per layer
        self.dense: dict[str, int] = {}        # floats a dense allreduce sends, per layer
        self.bytes: dict[str, int] = {}        # bytes on the wire per rank, per layer
        self.bytes_dense: dict[str, int] = {}  # bytes of the gradients themselves, per layer
        self.seconds: dict[str, float] = {"compress": 0.0, "comm": 0.0}
        self.steps = 0

    def gradient(self, name: str, numel: int, nbytes: int) -> None:
        """A gradient of ``name`` came in: what dense would send for it."""
        self.dense[name] = self.dense.get(name, 0) + numel
        self.bytes_dense[name] = self.bytes_dense.get(name, 0) + nbytes

    def floats(self, name: str, floats: int) -> None:
        self.sent[name] = self.sent.get(name, 0) + floats

    def wire(self, name: str, nbytes: int) -> None:
        self.bytes[name] = self.bytes.get(name, 0) + nbytes

    def totals(self) -> dict[str, int]:
        return {"floats_sent": sum(self.sent.values()), "floats_dense": sum(self.dense.values()),
                "bytes_sent": sum(self.bytes.values()), "bytes_dense": sum(self.bytes_dense.values())}

    def layer(self, name: str) -> dict[str, int]:
        # (sent.get: a layer counted only by steps that sent nothing yet, DiLoCo's inner steps)
        return {"floats_sent": self.sent.get(name, 0), "floats_dense": self.dense[name],
                "bytes_sent": self.bytes.get(name, 0), "bytes_dense": self.bytes_dense.get(name, 0)}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "sent": dict(self.sent), "dense": dict(self.dense), "seconds": dict(self.seconds),
                "bytes": dict(self.bytes), "bytes_dense": dict(self.bytes_dense)}

    @staticmethod
    def parse(state: dict) -> dict[str, Any]:
        """The counters of a ``state_dict`` read and checked (KeyError, TypeError or
        ValueError if malformed), without changing anything: ``load`` applies them."""
        return {"steps": int(state["steps"]),
                "sent": {str(k): int(v) for k, v in state["sent"].items()},
                "dense": {str(k): int(v) for k, v in state["dense"].items()},
                "seconds": {str(k): float(v) for k, v in state["seconds"].items()},
                "bytes": {str(k): int(v) for k, v in state.get("bytes", {}).items()},  # absent before they existed
                "bytes_dense": {str(k): int(v) for k, v in state.get("bytes_dense", {}).items()}}

    def load(self, parsed: dict[str, Any]) -> None:
        self.steps = parsed["steps"]
        for live, key in ((self.sent, "sent"), (self.dense, "dense"), (self.seconds, "seconds"),
                          (self.bytes, "bytes"), (self.bytes_dense, "bytes_dense")):
            live.clear()
            live.update(parsed[key])
