"""Accordion's rule driving the batch size instead of the compression level (batch-size mode).

The paper's second use of critical-regime detection: a small batch in critical regimes, a
large one otherwise (their runs: 32 vs 256 per worker). With Horovod the batch grows by
gradient accumulation: ``backward_passes_per_step`` micro-batches per optimizer step, set
on the ``DistributedOptimizer`` at run time, with the learning rate scaled by the same
factor (linear scaling). Fewer optimizer steps means fewer allreduces: a large batch is
communication saved, and it combines with ``AccordionCompressor``.

    opt = hvd.DistributedOptimizer(opt, named_parameters=..., compression=...)
    batch = acc.AccordionBatchSize(opt, small=1, large=8)
    for i, (x, y) in enumerate(loader):            # loader yields micro-batches
        (loss_fn(model(x), y) / batch.passes).backward()
        if batch.micro_batch_done():               # True every `batch.passes` micro-batches
            opt.step()
            batch.step()                           # reads the gradient; may switch passes and lr
            opt.zero_grad()

Detection uses the whole model's gradient (the averaged one, after ``opt.step()``), summed
over the window and weighted by each step's micro-batches, so the window's measure, the
norm of the mean micro-batch gradient, does not depend on the batch size in use (a
model-sized float32 buffer: the memory cost of detection). The decisions go
through the same controller as the compressor's, so every rank switches in the same step.
The learning rates the controller watches are the user's (ours divided out), so a schedule's
decay still sends the run to the small batch until the next detection point. An
``AccordionCompressor`` on the same optimizer sees our scaling as learning-rate changes: a
switch to the small batch (a lower rate) also makes its layers critical, which is the same
regime call.
"""

from __future__ import annotations

from typing import Any

import torch

from .levels import CRITICAL, Level, positive_number
from .controller import RegimeController
from .policies import make_policy

_MODEL = "model"  # the controller's one pseudo-layer: the whole model


class AccordionBatchSize:
    """Args:
        optimizer: Horovod's ``DistributedOptimizer`` (needs ``set_backward_passes_per_step``).
        small, large: micro-batches per optimizer step in critical / normal regimes.
        eta: Accordion threshold on the relative change of the window's gradient norm.
        interval: detection window in optimizer steps; None: at each ``epoch_end()``.
        scale_lr: multiply the learning rate by passes / small (linear scaling rule).
        control: the control plane (default: MPI when its world is Horovod's, else Horovod).
    """

    def __init__(self, optimizer: Any, *, small: int = 1, large: int = 8, eta: float = 0.5,
                 interval: int | None = None, scale_lr: bool = True, control: Any = None) -> None:
        if not hasattr(optimizer, "set_backward_passes_per_step"):
            raise TypeError("optimizer must be Horovod's DistributedOptimizer (it has set_backward_passes_per_step), "
                            f"got {type(optimizer).__name__}")
        self.small = positive_number("small", small, integer=True)
        self.large = positive_number("large", large, integer=True)
        if self.large < self.small:
            raise ValueError(f"large must be >= small, got small={small}, large={large}")
        self.optimizer = optimizer
        self.scale_lr = bool(scale_lr)
        self.controller = RegimeController(make_policy("accordion", eta=eta, codec_adaptive=True), interval,
                                           accumulate=True)
        self._control = control
        self._scale = 1.0        # the factor our learning rates carry now
        self._micro = 0          # micro-batches done in this step
        self.passes = 0
        self._set_passes(self.small if self.controller.level_of(_MODEL) == CRITICAL else self.large)

    @property
    def control(self):
        if self._control is None:
            from .comm.control import control_plane
            self._control = control_plane("auto")
        return self._control

    def micro_batch_done(self) -> bool:
        """Count one backward pass; True when the optimizer step is due."""
        self._micro += 1
        return self._micro >= self.passes

    @torch.no_grad()
    def step(self) -> None:
        """After every ``optimizer.step()`` and before ``zero_grad()`` (all ranks): feed the
        detection with the step's averaged gradient, maybe switch."""
        self._micro = 0
        grads = [p.grad.reshape(-1) for group in self.optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if grads:  # the step's gradient is the mean of `passes` micro-batch gradients
            self.controller.observe(_MODEL, torch.cat(grads), weight=self.passes)
        changed = self.controller.end_step(self.control, [_MODEL], self._user_lrs())
        self._apply(changed)

    def epoch_end(self) -> None:
        """A detection point when ``interval`` is None."""
        self._apply(self.controller.epoch_end(self.control, [_MODEL]))

    def _apply(self, changed: dict[str, Level] | None) -> None:
        if changed:
            self._set_passes(self.small if changed[_MODEL] == CRITICAL else self.large)

    def _user_lrs(self) -> list[float]:
        return [group["lr"] / self._scale for group in self.optimizer.param_groups]

    def _set_passes(self, passes: int) -> None:
        scale = passes / self.small if self.scale_lr else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] / self._scale * scale
        self._scale, self.passes = scale, passes
        self.optimizer.set_backward_passes_per_step(passes)

    @property
    def lr_scale(self) -> float:
        """The factor the learning rates carry now (passes / small, or 1 without scale_lr):
        a schedule that sets the lr itself multiplies by it."""
        return self._scale

    @property
    def regime(self) -> Level:
        """CRITICAL (small batches) or NORMAL (large ones)."""
        return self.controller.level_of(_MODEL)

    def state_dict(self) -> dict:
        return {"passes": self.passes, "scale": self._scale, "micro": self._micro,
                "controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        # The optimizer's learning rates were restored with their scale: adopt it as ours.
        self._scale = float(state["scale"])
        self.passes = int(state["passes"])
        self._micro = int(state["micro"])
        self.optimizer.set_backward_passes_per_step(self.passes)
