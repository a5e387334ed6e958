"""Streaming reader for Chrome/Kineto trace JSON (plain or gzip): the top-level object's small values
and the elements of its `traceEvents` array one at a time, in bounded memory.

The text is read in chunks; each value is parsed by the C-accelerated `json.JSONDecoder.raw_decode`
at the current position, and only when a value runs past the end of the buffer is the next chunk
appended. Memory is one chunk plus the largest single value (capped by `max_value_bytes`, so a
corrupt file cannot make us read it whole). No third-party parser needed.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any, Iterator, TextIO

_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*([,\]])")
EVENTS_KEY = "traceEvents"


class TraceJsonError(ValueError):
    """Malformed or truncated trace JSON; the message gives the character offset."""


def open_text(path: str | Path) -> TextIO:
    """A text stream over a plain or gzip-compressed file (detected by its magic bytes)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, "r", encoding="utf-8", errors="replace")


class TraceJsonReader:
    """`for key, value in TraceJsonReader(path)`: ("meta key", value) for every top-level key but
    traceEvents, and (EVENTS_KEY, event) for each element of traceEvents, in file order. A file that is
    a bare array of events (old Chrome format) yields only (EVENTS_KEY, event) pairs."""

    def __init__(self, path: str | Path, chunk_chars: int = 1 << 20, max_value_bytes: int = 64 << 20) -> None:
        self.path = Path(path)
        self.chunk_chars = chunk_chars
        self.max_value_bytes = max_value_bytes
        self._decoder = json.JSONDecoder()
        self._buf = ""
        self._pos = 0
        self._consumed = 0  # characters dropped from the front of the buffer so far
        self._eof = False
        self._stream: TextIO | None = None

    # ---- buffer ------------------------------------------------------------------------------
    def _fill(self) -> bool:
        if self._eof:
            return False
        assert self._stream is not None, "_fill runs inside __iter__, which opens the stream"
        chunk = self._stream.read(self.chunk_chars)
        if not chunk:
            self._eof = True
            return False
        self._consumed += self._pos
        self._buf = self._buf[self._pos:] + chunk
        self._pos = 0
        return True

    def _peek(self) -> str:
        """Next non-whitespace character ('' at the end of the file), not consumed."""
        while True:
            blank = _WS.match(self._buf, self._pos)
            assert blank is not None  # a `*` pattern always matches
            self._pos = blank.end()
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._fill():
                return ""

    def _expect(self, chars: str, what: str) -> str:
        c = self._peek()
        if c == "" or c not in chars:
            found = "the end of the file (truncated?)" if c == "" else repr(c)
            raise TraceJsonError(f"expected {what} at character {self.offset}, found {found}")
        self._pos += 1
        return c

    @property
    def offset(self) -> int:
        return self._consumed + self._pos

    def _value(self) -> Any:
        self._peek()
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                if len(self._buf) - self._pos > self.max_value_bytes:
                    raise TraceJsonError(f"malformed JSON value at character {self.offset} ({exc.msg})") from None
                if not self._fill():
                    raise TraceJsonError(f"the file ends inside a JSON value at character {self.offset} "
                                         "(truncated: the profiler or the copy did not finish)") from None
                continue
            if end == len(self._buf) and not self._eof and not isinstance(value, (dict, list, str)):
                # a number or literal at the end of the buffer may continue in the next chunk
                if self._fill():
                    continue
            self._pos = end
            return value

    # ---- structure ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[str, Any]]:
        with open_text(self.path) as stream:
            self._stream = stream
            try:
                first = self._peek()
            except UnicodeDecodeError:
                first = "?"
            if first == "[":
                self._pos += 1
                yield from self._events()
                return
            self._expect("{", "a JSON object (a PyTorch profiler trace starts with '{')")
            if self._peek() == "}":
                self._pos += 1
                return
            while True:
                key = self._value()
                if not isinstance(key, str):
                    raise TraceJsonError(f"expected a key string at character {self.offset}")
                self._expect(":", "':'")
                if key == EVENTS_KEY:
                    self._expect("[", "'[' starting traceEvents")
                    yield from self._events()
                else:
                    yield key, self._value()
                if self._expect(",}", "',' or '}'") == "}":
                    return

    def _events(self) -> Iterator[tuple[str, Any]]:
        if self._peek() == "]":
            self._pos += 1
            return
        decode, ws, sep = self._decoder.raw_decode, _WS.match, _SEP.match
        while True:
            # fast path (almost every event): the whole object and its separator are in the buffer
            buf = self._buf
            blank = ws(buf, self._pos)
            assert blank is not None  # a `*` pattern always matches
            pos = blank.end()
            try:
                value, end = decode(buf, pos)
                m = sep(buf, end) if isinstance(value, dict) else None
            except ValueError:
                m = None
            if m is not None:
                self._pos = m.end()
                yield EVENTS_KEY, value
                if m.group(1) == "]":
                    return
                continue
            yield EVENTS_KEY, self._value()
            if self._expect(",]", "',' or ']' in traceEvents") == "]":
                return
