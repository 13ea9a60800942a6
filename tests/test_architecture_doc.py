"""docs/architecture.md stays true: every module it names exists, every module of the package is named."""

from __future__ import annotations

import re

from tests.helpers import ROOT

DOC = (ROOT / "docs" / "architecture.md").read_text()


def package_modules() -> set[str]:
    """Paths relative to pretrain/, e.g. 'train.py', 'data/tokenizer.py' (a package's __init__ counts as
    its folder, 'data/')."""
    out = set()
    for path in (ROOT / "pretrain").rglob("*.py"):
        rel = path.relative_to(ROOT / "pretrain").as_posix()
        out.add(rel.removesuffix("__init__.py") if rel.endswith("__init__.py") and "/" in rel else rel)
    return out - {"__init__.py"}


def named_in_doc() -> set[str]:
    """Modules the doc names: 'pretrain/x.py', 'pretrain/pkg/', and bare 'x.py' under a '### ... (`pretrain/pkg/`)'
    heading (pkg may be nested: plan/memory)."""
    names = set(re.findall(r"pretrain/([\w/]+\.py|[\w]+/)", DOC))
    for pkg, body in re.findall(r"^### [^\n]*\(`pretrain/([\w/]+)/`\)\n(.*?)(?=^#)", DOC, re.MULTILINE | re.DOTALL):
        names |= {f"{pkg}/{name}" for name in re.findall(r"^    (\w+\.py)\b", body, re.MULTILINE)}
    return {n.replace("__init__.py", "") if n.endswith("/__init__.py") else n for n in names}


def test_every_module_the_doc_names_exists():
    missing = sorted(n for n in named_in_doc() if not (ROOT / "pretrain" / n).exists())
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_of_the_package_is_in_the_doc():
    unnamed = sorted(package_modules() - named_in_doc())
    assert unnamed == [], f"modules missing from docs/architecture.md: {unnamed}"
