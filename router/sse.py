"""Server-sent events as a decode node streams them, framed and told apart in one place.

An event is a run of lines ended by an empty line (`\\n\\n`). A node's stream carries five kinds:

* `COMMENT`: only `:` lines, the keep-alive a node writes while a request waits;
* `PREAMBLE`: a chat stream's opening chunk, its `delta` holding the role and empty content, no token;
* `TOKEN`: any other JSON event (a chunk of the answer, a usage chunk);
* `ERROR`: a JSON object with a top-level `error` (the request failed after its stream began);
* `DONE`: `data: [DONE]`, the stream's end.

`OTHER` is a data event that is not JSON. `Splitter.feed` cuts a byte stream into whole events however the
reads split it (an event that spans reads waits for its end); `Event.obj` decodes an event's JSON once, and
`Event.kind` reads it. JSON escapes newlines, so an empty line inside a string can never end an event, nor can
a text that spells `data: [DONE]` end a stream.
"""

from __future__ import annotations

import enum

import msgspec

_decode = msgspec.json.decode
_NOT_JSON = object()


class Kind(enum.Enum):
    COMMENT = "comment"
    PREAMBLE = "preamble"
    TOKEN = "token"
    ERROR = "error"
    DONE = "done"
    OTHER = "other"


class Event:
    """One whole event: `raw` its bytes, the empty line that ends it included; `data` its data field (the
    `data:` lines' values joined by newlines), None for an event of comments only."""

    __slots__ = ("raw", "data", "_obj", "_kind")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        if raw.startswith(b"data: ") and raw.find(b"\n") == len(raw) - 2:  # one data line, as nodes write
            self.data = raw[6:-2]
        else:
            values = [line[5:] for line in raw.split(b"\n") if line.startswith(b"data:")]
            self.data = b"\n".join(v[1:] if v.startswith(b" ") else v for v in values) if values else None
        self._obj = None  # decoded on first use
        self._kind: Kind | None = None

    @property
    def obj(self):
        """The data decoded as JSON (None for a comment, [DONE] or data that is not JSON)."""
        if self._obj is None:
            self._obj = _NOT_JSON
            if self.data is not None and self.data != b"[DONE]":
                try:
                    self._obj = _decode(self.data)
                except msgspec.DecodeError:
                    pass
        return None if self._obj is _NOT_JSON else self._obj

    @property
    def kind(self) -> Kind:
        if self._kind is None:
            self._kind = self._classify()
        return self._kind

    def _classify(self) -> Kind:
        if self.data is None:
            return Kind.COMMENT
        if self.data == b"[DONE]":
            return Kind.DONE
        obj = self.obj
        if obj is None:
            return Kind.OTHER
        if isinstance(obj, dict) and "error" in obj:
            return Kind.ERROR
        return Kind.PREAMBLE if _is_preamble(obj) else Kind.TOKEN

    @property
    def error(self) -> dict:
        """An error event's error object ({} when it is not an object)."""
        err = self.obj.get("error") if isinstance(self.obj, dict) else None
        return err if isinstance(err, dict) else {}


def _is_preamble(obj) -> bool:
    """A chat stream's role chunk: every choice's `delta` holds at most a role and empty content, with no
    finish reason and no logprobs, and there is no usage."""
    if not isinstance(obj, dict) or obj.get("usage"):
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for c in choices:
        delta = c.get("delta") if isinstance(c, dict) else None
        if not isinstance(delta, dict) or delta.get("content") or c.get("finish_reason") is not None \
                or c.get("logprobs") or set(delta) - {"role", "content"}:
            return False
    return True


class Splitter:
    """Cuts a stream's reads into whole events; `rest` holds the bytes of an event not yet ended."""

    __slots__ = ("rest",)

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> list[Event]:
        data = self.rest + chunk if self.rest else chunk
        *whole, self.rest = data.split(b"\n\n")
        return [Event(raw + b"\n\n") for raw in whole]


def events(body: bytes) -> list[Event]:
    """The events of a complete stream body, a last one without its empty line included."""
    splitter = Splitter()
    out = splitter.feed(body)
    if splitter.rest.strip():
        out.append(Event(splitter.rest))
    return out
