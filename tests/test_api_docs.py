"""docs/api.md stays true: every argument table matches the real signature (names, order,
defaults, keyword-only), every public name is documented, and so is every environment
variable the package reads."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import accordion_hvd as acc
import accordion_hvd.policies

REPO = Path(__file__).resolve().parent.parent
API = (REPO / "docs" / "api.md").read_text()

DOCUMENTED = {  # heading in docs/api.md -> the object whose signature its argument table describes
    "acc.AccordionCompressor": acc.AccordionCompressor,
    "acc.Compressor": acc.Compressor,
    "acc.PowerSGD": acc.PowerSGD,
    "acc.TopK": acc.TopK,
    "acc.Quantize": acc.Quantize,
    "acc.Sign": acc.Sign,
    "acc.OneBitAdam": acc.OneBitAdam,
    "acc.register_ddp_hook": acc.register_ddp_hook,
    "acc.compress_hsdp": acc.compress_hsdp,
    "acc.policies.Accordion": acc.policies.Accordion,
    "acc.policies.GraVAC": acc.policies.GraVAC,
    "acc.policies.LinkGate": acc.policies.LinkGate,
    "acc.policies.NetworkAware": acc.policies.NetworkAware,
    "acc.AccordionBatchSize": acc.AccordionBatchSize,
    "acc.quiet_horovod_cycle": acc.quiet_horovod_cycle,
}


def argument_table(heading: str) -> list[tuple[str, str, str]]:
    """(argument, default, meaning) rows of the first argument table under ``heading``."""
    match = re.search(rf"^#+ `{re.escape(heading)}`\n(.*?)(?=^#+ )", API + "\n# end", re.S | re.M)
    assert match, f"docs/api.md has no section `{heading}`"
    rows, in_table = [], False
    for line in match.group(1).splitlines():
        if line.startswith("| argument | default | meaning |"):
            in_table = True
        elif in_table and line.startswith("|---"):
            continue
        elif in_table and line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append((cells[0].strip("`"), cells[1].strip("`"), cells[2]))
        elif in_table:
            break
    assert rows, f"docs/api.md: no argument table under `{heading}`"
    return rows


@pytest.mark.parametrize("heading", sorted(DOCUMENTED))
def test_every_documented_argument_and_default_is_the_real_one(heading):
    params = [p for p in inspect.signature(DOCUMENTED[heading]).parameters.values() if p.name != "self"]
    rows = argument_table(heading)
    assert [r[0] for r in rows] == [p.name for p in params], f"{heading}: arguments documented vs real"
    for (name, default, meaning), param in zip(rows, params):
        if param.default is inspect.Parameter.empty:
            assert default == "", f"{heading}({name}): documented default {default!r}, but it is required"
        else:
            assert default, f"{heading}({name}): no documented default (real: {param.default!r})"
            assert ast.literal_eval(default) == param.default, \
                f"{heading}({name}): documented default {default}, real {param.default!r}"
        keyword_only = param.kind is inspect.Parameter.KEYWORD_ONLY
        assert meaning.startswith("keyword only") == keyword_only, \
            f"{heading}({name}): 'keyword only.' must lead its meaning exactly when it is keyword-only"


def test_every_public_name_is_documented():
    for name in acc.__all__:
        if name.startswith("__"):
            continue
        assert f"acc.{name}" in API, f"acc.{name} is not in docs/api.md"
    for name in accordion_hvd.policies.__all__:
        if name in ("Accordion", "GraVAC", "NetworkAware", "Static"):
            assert f"acc.policies.{name}" in API, f"acc.policies.{name} is not in docs/api.md"


def test_every_documented_method_exists():
    section = API[API.index("Methods (call them"):API.index("## Codecs")]
    for method in re.findall(r"^\| `(\w+)", section, re.M):
        if method in ("compress", "decompress"):
            continue
        assert hasattr(acc.AccordionCompressor, method), f"docs/api.md documents {method}, which does not exist"


def test_every_environment_variable_the_package_reads_is_documented():
    names = set()
    for path in (REPO / "accordion_hvd").rglob("*.py"):
        names.update(re.findall(r"\"(ACCORDION_[A-Z_]+)\"", path.read_text()))
    assert names, "found no environment variable: the pattern is stale"
    for name in sorted(names):
        assert f"`{name}`" in API, f"{name} is read by the package but not in docs/api.md"
