"""docs/configuration.md is generated from the config dataclasses (scripts/make_config_reference.py): a field added
or a help text changed in rlhf.py without regenerating the page fails here, so the reference cannot drift."""

from __future__ import annotations

import dataclasses

from conftest import REPO, load_script

import rlhf


def test_configuration_reference_is_up_to_date():
    script = load_script("scripts/make_config_reference.py")
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == script.render(), (
        "docs/configuration.md is out of date with the config dataclasses in rlhf.py: "
        "run `python scripts/make_config_reference.py` and commit the result")


def test_reference_lists_every_stage_key():
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    for cls in rlhf.STAGE_CONFIGS.values():
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in text, f"{cls.__name__}.{field.name} is missing from docs/configuration.md"
            assert field.metadata.get("help"), f"{cls.__name__}.{field.name} has no help text for --help and the docs"
