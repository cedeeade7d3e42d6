"""The docs are true to the code where a machine can tell: the configuration reference is the
config models' own docstrings, every field has one, and every link between pages lands."""

from __future__ import annotations

import importlib.util
import re

import pytest
from pydantic import BaseModel

from pdserve_core import config
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _generator():
    spec = importlib.util.spec_from_file_location("gen", REPO / "scripts/gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_generated_from_the_models():
    generator = _generator()
    text = generator.DOC.read_text()
    assert generator.render(text) == text, "run python scripts/gen_config_docs.py"


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield prefix + name, field
        inner = _generator().model_of(field.annotation)
        if inner is not None:
            yield from _fields(inner, f"{prefix}{name}.")


def test_every_config_field_says_what_it_does():
    def described(field) -> bool:  # a section may say it in its class's docstring instead
        inner = _generator().model_of(field.annotation)
        return bool(field.description or (inner and inner.__doc__))

    missing = [name for name, field in _fields(config.PDServeConfig) if not described(field)]
    assert missing == []
    reference = (REPO / "docs/configuration.md").read_text()
    for name, field in _fields(config.PDServeConfig):
        section, _, leaf = name.rpartition(".")
        inner = _generator().model_of(field.annotation)
        if inner is None or field.default is None:  # a value, or an optional section: a row
            assert f"| `{leaf}` |" in reference, name
        if inner is not None:
            assert f"### `{name}`" in reference, name


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page) -> set[str]:
    text, fenced = [], False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            text.append(_slug(line.lstrip("#")))
    return set(text)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_between_pages_lands(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert broken == []


def test_the_readme_is_short_enough_to_finish():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
