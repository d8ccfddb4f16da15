"""Policies: which compression level each layer uses, and when it changes.

A policy is pure decision logic. It sees only numbers that every rank holds identically
(window norms already reduced across ranks, the learning rate agreed by all), so every rank
applies the same rule to the same inputs and switches in the same step. Gathering those
numbers is the controller's job (accordion_hvd/controller.py).
"""

from .accordion import Accordion
from .base import NetworkReport, Policy, StepReport, WindowReport
from .gravac import GraVAC
from .link_gate import LinkGate
from .network_aware import NetworkAware
from .static import Static

__all__ = ["Accordion", "GraVAC", "LinkGate", "NetworkAware", "NetworkReport", "Policy", "Static", "StepReport",
           "WindowReport",
           "make_policy"]


def make_policy(policy, *, eta: float, codec_adaptive: bool, gate_pays: float | None = None) -> Policy:
    """``policy`` as given to AccordionCompressor: None (Accordion when the codec has two
    levels, else Static), a name ("accordion", "static", "gravac", "network-aware",
    "link-gate": LinkGate around what None gives, with the codec's ``gate_pays``: the
    library's default), or a Policy instance."""
    if policy is None:
        return Accordion(eta) if codec_adaptive else Static()
    if isinstance(policy, str):
        choices = {"accordion": lambda: Accordion(eta), "static": Static, "gravac": GraVAC,
                   "network-aware": lambda: NetworkAware(eta),
                   "link-gate": lambda: LinkGate(Accordion(eta) if codec_adaptive else Static(),
                                                 **({} if gate_pays is None else {"pays": gate_pays}))}
        if policy not in choices:
            raise ValueError(f"policy must be one of {sorted(choices)} or a Policy instance, got {policy!r}")
        return choices[policy]()
    if isinstance(policy, Policy):
        return policy
    raise TypeError(f"policy must be None, a name or a Policy instance, got {type(policy).__name__}")
