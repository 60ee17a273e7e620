"""The documentation's one source: every setting and model.yaml field documents itself (the site's
reference is generated from these descriptions), and every example of the Getting-started and how-to
pages is run by tests/e2e/test_docs_examples.py or marked illustrative with a reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from doc_examples import blocks, example_pages, mark_problems
from servewell.config.model import ModelConfig
from servewell.config.server import ServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import docs_reference


@pytest.mark.parametrize("tree", [ServerConfig, ModelConfig], ids=lambda tree: tree.__name__)
def test_every_field_of_the_config_trees_has_a_description(tree: type[BaseModel]) -> None:
    missing = docs_reference.undocumented(tree)
    assert not missing, (f"{tree.__name__}: fields without a description (Field(description=...) is their "
                         f"documentation and their --help): {missing}")


def test_a_field_without_a_description_is_found_however_deep_it_sits() -> None:
    # The check above must be able to fail: a nested section's undocumented field is reported with its path.
    class Inner(BaseModel):
        documented: int = Field(1, description="Says what it is.")
        bare: int = 2

    class Outer(BaseModel):
        sections: list[Inner] = Field(default_factory=list, description="Entries.")
        maybe: Inner | None = Field(None, description="An optional section.")

    assert docs_reference.undocumented(Outer) == ["sections[].bare", "maybe.bare"]


def test_the_reference_walks_every_section_of_model_yaml() -> None:
    paths = {row.path for row in docs_reference.walk_settings(ModelConfig)}
    for expected in ("batching.max_wait_ms", "pytorch.factory", "python.entry", "inputs[].datatype",
                     "rollout.rollback.max_p99_ratio", "pipeline.steps[].model", "cache.max_bytes"):
        assert expected in paths, expected


def test_every_example_on_the_getting_started_and_how_to_pages_is_run_or_says_why_not() -> None:
    pages = example_pages()
    assert {page.parent.name for page in pages} == {"getting-started", "how-to"}, pages
    problems = [f"{block.where}: {problem}" for page in pages for block in blocks(page)
                for problem in mark_problems(block)]
    assert not problems, "\n".join(problems)


def test_a_block_without_a_reason_or_a_language_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- illustrative -->\n```sh\nrm -rf /\n```\n\n```\nno language\n```\n\n"
                    "<!-- sometimes -->\n```python\nprint(1)\n```\n\n```console\n$ servewell serve\n```\n")
    found = [problem for block in blocks(page) for problem in mark_problems(block)]
    assert len(found) == 4, found
