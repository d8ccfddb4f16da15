"""``--sync ours-onebit-adam``: ``acc.OneBitAdam`` over the CLI's AdamW (accordion_hvd/
onebit_adam.py), under torchrun: its warm-up through the per-step default's 8-bit sparse
chunks for ``--freeze-step`` steps, then the frozen second moment and the momentum in 1 bit
(``acc.Sign``). Its codecs are its own (``--codec none`` for the CLI's); what crossed the wire
is counted by its compressors (``wire_bits`` in steps.csv, this rank's)."""

from __future__ import annotations

from ..periodic.onebit_adam import OneBitAdam
from .frontends import DDPFrontEnd
from .periodic import broadcast_model


class OursOneBitAdamFrontEnd(DDPFrontEnd):
    """The model not wrapped; ``acc.OneBitAdam`` exchanges and steps every step."""

    name = sync = "ours-onebit-adam"

    def __init__(self, device_type: str, freeze_step: int, max_update: float | None) -> None:
        super().__init__(device_type)
        self.freeze_step, self.max_update = freeze_step, max_update
        self.label = f"torchrun, acc.OneBitAdam (freeze_step={freeze_step}, max_update={max_update})"
        self.onebit = None

    def wrap(self, model, opt, compression, device):
        broadcast_model(model, self.dist)  # every rank starts from rank 0's model, as DDP would
        self.onebit = OneBitAdam(model, opt, freeze_step=self.freeze_step, max_update=self.max_update)
        self.numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return model, opt

    def step(self, opt, compression) -> None:
        compression.count(0, dense=self.numel)  # (the CLI's counters: nothing through its compression)
        self.onebit.step()

    def record(self) -> dict:
        return {"sync_interval": 1, "syncs": self.onebit.steps, "wire_bits": 8 * self.onebit.stats()["bytes_sent"]}

    def sync_state(self):
        return self.onebit.state_dict()

    def load_sync_state(self, state) -> None:
        self.onebit.load_state_dict(state)
