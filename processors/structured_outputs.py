"""``StructuredOutputsParams``: vLLM's constraint fields, exactly one kind per request."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, fields
from typing import Any

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF
    json_object: bool | None = None  # any JSON object
    # xgrammar is the only backend: there is nothing to fall back to, so this changes nothing.
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    # xgrammar compiles schemas strictly (as vLLM's xgrammar backend does): an object without an
    # explicit ``additionalProperties`` already admits no other keys, whatever this says.
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {list(CONSTRAINT_KINDS)}, got {kinds or 'none'}."
            )
        if isinstance(self.json, str):
            try:
                jsonlib.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError("structured_outputs.json nests too deeply to be parsed") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a schema (object or string), got {type(self.json).__name__}.")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                             "use disable_any_whitespace.")

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """Identity of the compiled grammar (the compile cache's key)."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = jsonlib.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace, self.disable_additional_properties

    def to_dict(self) -> dict[str, Any]:
        """The fields set, shallow (``asdict`` recurses once per level of a schema)."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) != f.default}

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams | None:
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {unknown}; known: {sorted(known)}.")
        return cls(**value)


# vLLM's older request fields, still sent by many clients: guided_x -> structured_outputs.x.
GUIDED_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}
