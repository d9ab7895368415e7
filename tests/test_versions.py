"""The supported version ranges are stated once, in pyproject.toml, and the run-time check reads
them from there (a source tree) or from the installed distribution's metadata (a wheel)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lmkernels import _versions
from lmkernels.registry import LMKernelsError

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("torch", "triton", "transformers", "trl", "peft")


def _pyproject() -> dict:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_runtime_check_reads_the_pyproject_ranges():
    from packaging.requirements import Requirement

    project = _pyproject()
    stated = [Requirement(r) for r in project["dependencies"]]
    stated += [Requirement(r) for items in project["optional-dependencies"].values() for r in items]
    for dist in CHECKED:
        specs = [r.specifier for r in stated if r.name == dist]
        assert len(specs) == 1, f"{dist}: stated {len(specs)} times in pyproject.toml"
        assert str(specs[0]), f"{dist}: no supported range in pyproject.toml"
        assert _versions.supported(dist) == specs[0]


def test_no_other_copy_of_the_ranges_in_the_source():
    """The transformers bound lives in pyproject.toml only (the runtime reads it)."""
    bound = str(_versions.supported("transformers")).split(",")
    for path in (ROOT / "src").rglob("*.py"):
        text = path.read_text()
        for spec in bound:
            assert f'"{spec}' not in text and f"'{spec}" not in text, (path, spec)


def test_check_refuses_versions_outside_the_range():
    spec = _versions.supported("transformers")
    upper = next(s.version for s in spec if s.operator == "<")
    _versions.check("transformers", "5.0.0")
    for version in ("4.57.1", upper, f"{upper}.dev0", "6.0.0"):
        with pytest.raises(
            LMKernelsError, match=rf"transformers {version} is not supported: .*lmkernels\[hf\]"
        ):
            _versions.check("transformers", version)
    assert _versions.problem("torch", "2.5.1") is not None and _versions.problem("torch", "2.13.0") is None
    assert _versions.problem("not-a-dependency", "1.0") is None


def test_installed_metadata_is_read_when_there_is_no_source_tree(monkeypatch):
    """A wheel: no pyproject.toml beside the package, the distribution's Requires-Dist instead."""
    requires = ["torch>=2.6", 'transformers<5.3,>=5.0; extra == "hf"', 'lmkernels[hf]; extra == "test"']
    monkeypatch.setattr(_versions, "_pyproject_requirements", lambda: None)
    monkeypatch.setattr(_versions.metadata, "requires", lambda dist: requires)
    _versions.requirements.cache_clear()
    try:
        assert str(_versions.supported("transformers")) == "<5.3,>=5.0"
        with pytest.raises(LMKernelsError, match="transformers 5.3.0 is not supported"):
            _versions.check("transformers", "5.3.0")
        assert _versions.supported("lmkernels") is None
    finally:
        _versions.requirements.cache_clear()


def test_the_transformers_integration_checks_the_same_range():
    pytest.importorskip("transformers", reason="the transformers integration needs the hf extra")
    from lmkernels.integrations import transformers as lk_hf

    lk_hf.check_transformers_version()  # the installed one is supported
    upper = next(s.version for s in _versions.supported("transformers") if s.operator == "<")
    with pytest.raises(LMKernelsError, match=f"transformers {upper} is not supported"):
        lk_hf.check_transformers_version(upper)
