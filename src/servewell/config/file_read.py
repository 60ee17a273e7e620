"""Reading a configuration file without trusting what sits at its path.

A FIFO moved into place as model.yaml froze the whole server 24.5 s at every poll (`open` waits
for a writer, `read` for data); a 10 MB model.yaml of comments blocked the event loop 2.8 s.
`read_config_bytes` reads only regular files (checked before and after a non-blocking open, so a
swap in between is caught), at most `max_bytes` of them; callers on the event loop run it in a
thread (`config.watch` does).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: Default for `config_max_bytes`: the largest model.yaml, --config or keys file read. A real
#: model.yaml is a few KB; labels for 20,000 classes are about 400 KB.
DEFAULT_MAX_CONFIG_BYTES = 1_048_576


class ConfigReadError(OSError):
    """The file is not a regular file, is too big, or cannot be read (the message says which)."""


def read_config_bytes(path: Path, max_bytes: int = DEFAULT_MAX_CONFIG_BYTES) -> bytes:
    """The content of the regular file at `path` (symlinks followed); `ConfigReadError` for a FIFO,
    device, socket or directory, a file over `max_bytes`, or one that cannot be opened."""
    try:
        info = os.stat(path)
        _check(info, max_bytes)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except ConfigReadError:
        raise
    except OSError as exc:
        raise ConfigReadError(f"cannot read: {exc.strerror or exc}") from None
    try:
        _check(os.fstat(fd), max_bytes)  # what was opened, in case the path was swapped after the stat
        chunks = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except ConfigReadError:
        raise
    except OSError as exc:
        raise ConfigReadError(f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ConfigReadError(f"larger than the limit of {max_bytes} bytes (config_max_bytes)")
    return data


def _check(info: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a directory" if stat.S_ISDIR(info.st_mode) \
            else "a device or socket"
        raise ConfigReadError(f"is {kind}, not a regular file (only regular files are read)")
    if info.st_size > max_bytes:
        raise ConfigReadError(f"is {info.st_size} bytes, over the limit of {max_bytes} bytes (config_max_bytes)")


def decode_utf8(data: bytes) -> str:
    """`data` as UTF-8 text; `ConfigReadError` naming the first bad byte's offset otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigReadError(f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
