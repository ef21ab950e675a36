"""The house rules of issue 9, kept by tests: the map names only files that exist, and no
file of the package grows past the sizes that keep it readable."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def test_architecture_map_names_only_files_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:comlrl|workers|tests|deploy|examples|benchmarks)/[\w/.-]+)`",
                           text))
    assert len(named) >= 20
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def test_package_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for folder in ("comlrl", "workers") for p in (ROOT / folder).rglob("*.py")}
    assert sizes["comlrl/trainers/reinforce/magrpo.py"] < 350
    too_big = {path: n for path, n in sizes.items() if n > 450}
    assert not too_big, too_big
