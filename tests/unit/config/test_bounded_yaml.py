"""The bounded YAML loader: what a small config file may expand to (depth, aliases, nodes)."""

from __future__ import annotations

import time

import pytest
import yaml

from servewell.config.bounded_yaml import YamlLimitError, YamlLimits, cut, load_bounded, short_yaml_error


def billion_laughs(levels: int = 9) -> str:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        prev, name = chr(96 + i), chr(97 + i)
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_ordinary_documents_load_as_safe_load_does() -> None:
    text = "a: &x [1, 2.5, yes, null]\nb: *x\nc: {d: 'e', f: [g]}\n"
    assert load_bounded(text) == yaml.safe_load(text)
    assert load_bounded(b"k: v\n") == {"k": "v"}


def test_nested_anchors_are_refused_by_their_expanded_size() -> None:
    text = billion_laughs()
    assert len(text) < 1100  # the 1,047-byte file that blocked the loop 13.2 s at 2.54 GB
    started = time.perf_counter()
    with pytest.raises(YamlLimitError, match="nodes"):
        load_bounded(text)
    assert time.perf_counter() - started < 0.5  # refused while composing, long before it expands


def test_deep_nesting_is_refused_before_recursion() -> None:
    # 600 levels made PyYAML raise RecursionError, which killed the watcher silently.
    with pytest.raises(YamlLimitError, match="deeper than 32"):
        load_bounded("a: " + "[" * 600 + "]" * 600)
    with pytest.raises(YamlLimitError, match="deeper"):
        load_bounded("a:\n" + "".join("  " * i + f"- k{i}:\n" for i in range(1, 200)))
    assert load_bounded("a: " + "[" * 30 + "]" * 30) is not None


def test_too_many_aliases_and_recursive_aliases_are_refused() -> None:
    with pytest.raises(YamlLimitError, match="aliases"):
        load_bounded("a: &a 1\nb: [" + ", ".join(["*a"] * 100) + "]\n", YamlLimits(max_aliases=64))
    with pytest.raises(YamlLimitError, match="contains it"):
        load_bounded("a: &a [1, *a]\n")


def test_a_megabyte_of_comments_costs_little_and_errors_stay_short() -> None:
    started = time.perf_counter()
    assert load_bounded(("# " + "x" * 98 + "\n") * 10_000 + "a: 1\n") == {"a": 1}
    assert time.perf_counter() - started < 1.0
    with pytest.raises(yaml.YAMLError) as raised:
        load_bounded("a: [" + "x" * 1_000_000 + "\n")
    assert len(short_yaml_error(raised.value)) <= 340
    assert cut("y" * 1000, 10).startswith("yyyyyyyyyy... (990 more")
