"""docs/architecture.md's table of the ways into a model against the admission chain the engine
really builds: a stage or observer added, removed or reordered in the code without the page
fails here."""

from __future__ import annotations

from pathlib import Path

from servewell.engine.engine import InferenceEngine

PAGE = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"


def table_columns() -> list[str]:
    text = PAGE.read_text()
    table = text.split("<!-- admission-table -->", 1)[1].split("<!-- /admission-table -->", 1)[0]
    header = next(line for line in table.splitlines() if line.startswith("| way into a model"))
    return [cell.strip() for cell in header.strip("|").split("|")][1:]


def test_the_architecture_table_names_the_chains_stages_and_observers_in_order(tmp_path: Path) -> None:
    chain = InferenceEngine(tmp_path, 1.0).chain
    built = [*chain.names, *(type(observer).__name__ for observer in chain.observers)]
    assert table_columns() == built


def test_every_row_says_something_for_every_column() -> None:
    text = PAGE.read_text()
    table = text.split("<!-- admission-table -->", 1)[1].split("<!-- /admission-table -->", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|") and not line.startswith(("| way", "|---"))]
    assert len(rows) >= 5
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == len(table_columns()) + 1 and all(cells), row
