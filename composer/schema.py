"""The JSON Schema of the spec language, generated from the pydantic models (never hand-written)."""

from __future__ import annotations

import json
from pathlib import Path

from composer.spec import spec_model

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "schemas" / "spec.schema.json"


def spec_schema(builtins_only: bool = True) -> dict:
    """The committed schema covers built-in kinds only; builtins_only=False adds installed plugins' kinds."""
    schema = spec_model(builtins_only=builtins_only).model_json_schema(by_alias=True, mode="validation")
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$id": "https://algorithm-composer/spec.schema.json", **schema}
    return _fix_inf(schema)


def _fix_inf(value):
    # JSON has no infinity: defaults such as beta1=.inf are written as the string "Infinity"
    if isinstance(value, dict):
        return {k: _fix_inf(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fix_inf(v) for v in value]
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def write_schema(path: Path | None = None, builtins_only: bool = True) -> Path:
    path = path or DEFAULT_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec_schema(builtins_only), indent=2, sort_keys=False) + "\n")
    return path
