"""Server settings come from one typed tree with one precedence: CLI flag > SERVEWELL_<FIELD>
environment variable > --config file > default."""

from __future__ import annotations

from pathlib import Path

import pytest

from servewell.config.server import ConfigFileError, ServerConfig, load_server_config


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "servewell.yaml"
    path.write_text(text)
    return path


def test_defaults_when_nothing_is_given():
    settings = load_server_config(None, {}, environ={})
    assert settings == ServerConfig()
    assert settings.port == 8000 and settings.log_format == "json"


def test_each_source_overrides_the_ones_below_it(tmp_path):
    file = config_file(tmp_path, "port: 9001\nlog_level: warning\nslow_request_ms: 50\n")
    environ = {"SERVEWELL_PORT": "9002", "SERVEWELL_LOG_LEVEL": "error"}
    settings = load_server_config(file, {"port": 9003}, environ=environ)
    assert settings.port == 9003  # flag over environment, file and default
    assert settings.log_level == "error"  # environment over file and default
    assert settings.slow_request_ms == 50  # file over default
    assert settings.host == "127.0.0.1"  # default


def test_an_unset_flag_does_not_hide_the_sources_below_it(tmp_path):
    file = config_file(tmp_path, "port: 9001\n")
    settings = load_server_config(file, {"port": None, "host": None}, environ={"SERVEWELL_HOST": "0.0.0.0"})
    assert settings.port == 9001 and settings.host == "0.0.0.0"


def test_list_settings_come_comma_separated_from_the_environment():
    settings = load_server_config(None, {}, environ={"SERVEWELL_LATENCY_BUCKETS_S": "0.01,0.1,1"})
    assert settings.latency_buckets_s == [0.01, 0.1, 1.0]


def test_only_servewell_variables_are_read():
    settings = load_server_config(None, {}, environ={"PORT": "1234", "servewell_port": "1235"})
    assert settings.port == 8000


@pytest.mark.parametrize(("text", "environ", "expected"), [
    ("port: 70000\n", {}, "field 'port'"),
    ("no_such_setting: 1\n", {}, "field 'no_such_setting'"),
    ("", {"SERVEWELL_MAX_BODY_BYTES": "lots"}, "field 'max_body_bytes'"),
    ("- a list\n", {}, "expected a mapping"),
    ("port: [unclosed\n", {}, "not valid YAML"),
])
def test_invalid_settings_name_their_source_and_field(tmp_path, text, environ, expected):
    file = config_file(tmp_path, text)
    with pytest.raises(ConfigFileError, match=expected) as raised:
        load_server_config(file, {}, environ=environ)
    assert str(file) in str(raised.value)


def test_a_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_server_config(tmp_path / "absent.yaml", {}, environ={})


@pytest.mark.parametrize(("environ", "expected"), [
    ({"SERVEWELL_API_KEYS": ""}, "api_keys.*holds no key"),  # set but empty: never "open"
    ({"SERVEWELL_API_KEYS": " , "}, "api_keys.*holds no key"),
    ({"SERVEWELL_ADMIN_TOKEN": ""}, "admin_token.*set but empty"),  # fell back to loopback = anyone behind a proxy
    ({"SERVEWELL_ADMIN_TOKEN": "   "}, "admin_token.*set but empty"),
    ({"SERVEWELL_METRICS_REQUIRE_KEY": "true"}, "metrics_require_key needs API keys"),
])
def test_security_settings_that_are_set_but_empty_fail_closed(environ, expected):
    with pytest.raises(ConfigFileError, match=expected):
        load_server_config(None, {}, environ)


def test_hostile_config_files_are_refused_with_a_short_reason(tmp_path):
    deep = config_file(tmp_path, "log_level: " + "[" * 600 + "]" * 600 + "\n")
    with pytest.raises(ConfigFileError, match="deeper than") as raised:
        load_server_config(deep, {}, {})
    assert len(str(raised.value)) < 600
    big = tmp_path / "big.yaml"
    big.write_text("#" * 2_000_000)
    with pytest.raises(ConfigFileError, match="over the limit"):
        load_server_config(big, {}, {})
