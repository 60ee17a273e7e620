"""List settings are read from text by their type annotation, not by their name (environment and CLI)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from servewell.cli import build_parser
from servewell.config.fields import list_item_type, split_items, values_from_env
from servewell.config.server import ConfigFileError, load_server_config


class Example(BaseModel):
    ports: list[int] = []
    names: list[str] | None = None
    ratio: float = 0.5
    label: str | None = None


def test_every_list_field_is_split_from_the_environment() -> None:
    environ = {"X_PORTS": "80, 443", "X_NAMES": "a,b,,c", "X_RATIO": "0.25", "X_LABEL": "a,b", "OTHER": "1"}
    values = values_from_env(Example, environ, "X_")
    assert values == {"ports": ["80", "443"], "names": ["a", "b", "c"], "ratio": "0.25", "label": "a,b"}
    assert Example.model_validate(values).ports == [80, 443]


@pytest.mark.parametrize(("annotation", "item"), [
    (list[float], float), (list[int] | None, int), (tuple[str, ...], str), (list, str),
    (float, None), (str | None, None),
])
def test_list_item_type(annotation: object, item: object) -> None:
    assert list_item_type(annotation) is item


def test_split_items_drops_blanks() -> None:
    assert split_items(" 1, ,2 ,") == ["1", "2"]


def test_server_list_settings_come_from_the_environment() -> None:
    settings = load_server_config(None, {}, {"SERVEWELL_LATENCY_BUCKETS_S": "0.1,0.5,1"})
    assert settings.latency_buckets_s == [0.1, 0.5, 1.0]


def test_a_bad_list_item_in_the_environment_names_the_item() -> None:
    with pytest.raises(ConfigFileError, match=r"field 'latency_buckets_s.1'"):
        load_server_config(None, {}, {"SERVEWELL_LATENCY_BUCKETS_S": "0.1,soon"})


def test_list_flags_take_comma_separated_items_of_their_type(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--latency-buckets-s", "0.1, 0.5,1", "--cache-dir", str(tmp_path)])
    assert args.latency_buckets_s == [0.1, 0.5, 1.0] and args.cache_dir == tmp_path


def test_a_bad_list_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--latency-buckets-s", "0.1,soon"])
    assert "invalid comma-separated float value: '0.1,soon'" in capsys.readouterr().err
