"""API keys read at start fail closed: a configured keys file that yields no key, or cannot be
read as text, is an error, never "inference is open"."""

from __future__ import annotations

from pathlib import Path

import pytest

from servewell.config.server import ServerConfig
from servewell.live_config import load_keys
from servewell.tenancy.keys import KeyFormatError, NoKeysError


@pytest.mark.parametrize("content", [b"", b"# every key revoked\n\n", b"   \n"])
def test_an_empty_or_comment_only_keys_file_is_an_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "keys.txt"
    path.write_bytes(content)
    with pytest.raises(NoKeysError, match="holds no key"):
        load_keys(ServerConfig(api_keys_file=path))


def test_a_keys_file_with_a_non_utf8_byte_is_a_key_error_not_a_crash(tmp_path: Path) -> None:
    # UnicodeDecodeError escaped the watcher's except clause and stopped polling for good.
    path = tmp_path / "keys.txt"
    path.write_bytes(b"team:abcdefghijklmnop\xff\n")
    with pytest.raises(KeyFormatError, match="not UTF-8"):
        load_keys(ServerConfig(api_keys_file=path))
    path.unlink()
    with pytest.raises(KeyFormatError, match="cannot read"):
        load_keys(ServerConfig(api_keys_file=path))


def test_env_keys_with_an_emptied_file_keep_only_the_env_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("# revoked\n")
    ring = load_keys(ServerConfig(api_keys_file=path, api_keys=["env:abcdefghijklmnopqrst"]))
    assert ring.ids == ("env",)
