"""What rank 0 says about levels (logger ``accordion_hvd.levels``): one line per switch for
the whole job (every rank switches alike), once per new set the layers that have had no
gradient on any rank in any detection window, and the policy's verdict for the whole job
when it takes one (the link gate's: compress or send 16-bit dense)."""

from __future__ import annotations

from ..log import announce, levels_log


class LevelAnnouncer:
    def __init__(self) -> None:
        self.said_unused: frozenset[str] = frozenset()  # the unused layers last logged
        self.said_at_window = 0                          # the detection window they were looked at
        self.said_verdict: str | None = None             # the policy's verdict last logged

    def levels(self, step: int, applied: dict[str, list[str]], controller) -> None:
        """``applied``: level -> the layers switched to it after ``step``."""
        if applied:
            unused = controller.unused()
            parts = []
            for level, names in sorted(applied.items()):
                names = [n for n in names if n not in unused]  # a layer with no gradient: said once, below
                if names:
                    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                    parts.append(f"{len(names)} layer{'s' if len(names) > 1 else ''} to {level} ({shown})")
            if parts:
                announce(levels_log, "after step %d: %s", step, "; ".join(parts))
        self._unused(step, controller)

    def _unused(self, step: int, controller) -> None:
        """Looked at once per detection window (when the window norms change)."""
        if controller.windows == self.said_at_window:
            return
        self.said_at_window = controller.windows
        unused = controller.unused()
        if unused and unused != self.said_unused:
            announce(levels_log, "after step %d: %d layer%s had no gradient on any rank in any detection window so far "
                     "(%s); stats() marks them unused", step, len(unused), "s" if len(unused) > 1 else "",
                     ", ".join(sorted(unused)[:4]) + (" ..." if len(unused) > 4 else ""))
        self.said_unused = unused

    def verdict(self, step: int, verdict: dict | None) -> None:
        """The policy's verdict (``Policy.verdict()``), once when it is taken (or changes)."""
        if verdict is None or verdict["verdict"] in ("pending", self.said_verdict):
            return
        self.said_verdict = verdict["verdict"]
        announce(levels_log, "after step %d: %s", step, verdict["summary"])
