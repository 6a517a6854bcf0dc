"""The spec language: YAML loading with locations, the pydantic spec models built from the registry, the JSON Schema, located diagnostics, the reference, numeric schedules (curves)."""
