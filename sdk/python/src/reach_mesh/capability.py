"""What an agent declares about each capability it serves: :class:`Capability`, with the
description and input/output JSON Schemas the registry serves from ``ListCapabilities`` (and
a model choosing tools reads) — the Rust SDK's ``DescribedCapability``.

The registry checks a registration and refuses it (``INVALID_ARGUMENT``) when a name is not a
dotted name, a version is not semver, a description is over 1024 bytes or holds control or
bidirectional-override characters, or a schema is over 64 KiB, nests deeper than 32 or does
not compile as a JSON Schema. :meth:`Capability.check` checks all of that except compiling
the schema, so :meth:`reach_mesh.AgentRuntime.start` fails at once with the reason instead of
retrying a registration the registry will keep refusing.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Final

from reach.v1 import registry_service_pb2

__all__ = [
    "MAX_DESCRIPTION_BYTES",
    "MAX_NAME_BYTES",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "Capability",
    "is_name",
]

#: The most bytes of UTF-8 a description may hold (the registry's bound).
MAX_DESCRIPTION_BYTES: Final = 1024
#: The most bytes of compact JSON text a schema may hold (the registry's bound).
MAX_SCHEMA_BYTES: Final = 64 * 1024
#: The deepest a schema may nest objects and arrays (the registry's bound).
MAX_SCHEMA_DEPTH: Final = 32
#: The longest service, capability or topic name, in bytes (the registry's bound).
MAX_NAME_BYTES: Final = 256

_SEGMENT = re.compile(r"[A-Za-z0-9_-]+")
# semver 2.0.0 (https://semver.org/#is-there-a-suggested-regular-expression-regex-to-check-a-semver-string)
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?"
)
# Bidirectional overrides and isolates (U+202A..U+202E, U+2066..U+2069).
_BIDI_CONTROLS: Final = frozenset(chr(c) for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)])


def is_name(name: str) -> bool:
    """Whether ``name`` is a dotted name the registry accepts for a service, capability or
    topic: 1 to 256 bytes, dot-separated non-empty segments of ASCII letters, digits, ``_``
    and ``-`` (``executor.servicing``)."""
    return (
        0 < len(name.encode()) <= MAX_NAME_BYTES
        and all(_SEGMENT.fullmatch(segment) for segment in name.split("."))
    )


@dataclass(frozen=True)
class Capability:
    """A capability an agent serves, with what it declares about it.

    Attributes:
        name: the capability name, dotted (``complaint.servicing``).
        version: the semver version served (``1.2.0``); empty means ``0.0.0``.
        description: what it does, when to use it and when not to, for a person or a model
            choosing a tool (at most 1024 bytes of UTF-8); empty declares none.
        input_schema: the JSON Schema of a request's first data part (a dict, or a bool);
            ``None`` declares none.
        output_schema: the JSON Schema of a reply's first data part; ``None`` declares none.
    """

    name: str
    version: str = ""
    description: str = ""
    input_schema: dict[str, Any] | bool | None = None
    output_schema: dict[str, Any] | bool | None = None

    def check(self) -> None:
        """Checks the registry's bounds (see the module docs).

        Raises:
            ValueError: what is wrong, naming the capability and the field.
        """
        if not is_name(self.name):
            raise ValueError(
                f"capability name {self.name!r} must be a dotted name of ASCII letters, "
                "digits, '_' and '-', at most 256 bytes (for example \"complaint.servicing\")"
            )
        if self.version and not _SEMVER.fullmatch(self.version):
            raise ValueError(
                f"capability {self.name!r}: the version {self.version!r} must be a semver "
                "version such as \"1.2.0\""
            )
        size = len(self.description.encode())
        if size > MAX_DESCRIPTION_BYTES:
            raise ValueError(
                f"capability {self.name!r}: the description is {size} bytes, over the limit "
                f"of {MAX_DESCRIPTION_BYTES}; say in a few sentences what it does and when to use it"
            )
        for char in self.description:
            if (unicodedata.category(char) == "Cc" and char not in "\n\t") or char in _BIDI_CONTROLS:
                raise ValueError(
                    f"capability {self.name!r}: the description contains U+{ord(char):04X}; "
                    "send plain text (only \\n and \\t are allowed besides printable characters)"
                )
        for field, schema in (("input_schema", self.input_schema), ("output_schema", self.output_schema)):
            if schema is None:
                continue
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    f"capability {self.name!r}: the {field} must be a dict or a bool (a JSON "
                    f"Schema), not a {type(schema).__name__}"
                )
            try:
                text = _schema_text(schema)
            except (TypeError, ValueError) as error:
                raise ValueError(f"capability {self.name!r}: the {field} is not JSON: {error}") from None
            size = len(text.encode())
            if size > MAX_SCHEMA_BYTES:
                raise ValueError(
                    f"capability {self.name!r}: the {field} is {size} bytes of JSON, over the "
                    f"limit of {MAX_SCHEMA_BYTES}"
                )
            nesting = _depth(schema)
            if nesting > MAX_SCHEMA_DEPTH:
                raise ValueError(
                    f"capability {self.name!r}: the {field} nests {nesting} levels deep, over "
                    f"the limit of {MAX_SCHEMA_DEPTH}; flatten it with $defs and $ref"
                )

    def to_proto(self) -> registry_service_pb2.Capability:
        """The registration's ``reach.v1.Capability``: schemas as compact JSON text, absent
        ones as empty strings."""
        return registry_service_pb2.Capability(
            name=self.name,
            version=self.version,
            description=self.description,
            input_schema="" if self.input_schema is None else _schema_text(self.input_schema),
            output_schema="" if self.output_schema is None else _schema_text(self.output_schema),
        )


def _schema_text(schema: dict[str, Any] | bool) -> str:
    """Compact JSON, as serde_json writes it (no spaces, non-ASCII kept)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _depth(value: Any) -> int:
    """How deep ``value`` nests dicts and lists (a scalar is 0), found iteratively."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in item)
    return deepest
