"""``--help``: the config groups a command reads, for Hydra's page (Hydra's own list is every group under conf/,
the training's among them on src.predict's page)."""

from __future__ import annotations

from pathlib import Path

import yaml

CONF = Path(__file__).resolve().parents[2] / "conf"


def config_groups(config_name: str) -> str:
    """``group: option, option`` for each group in the defaults list of ``conf/<config_name>.yaml`` (the hydra group
    aside), as Hydra's page writes them; an optional group (``experiment``) is chosen the same way, ``group=option``."""
    defaults = (yaml.safe_load((CONF / f"{config_name}.yaml").read_text()) or {}).get("defaults") or []
    lines = []
    for entry in defaults:
        if not isinstance(entry, dict):
            continue  # _self_
        ((key, _),) = entry.items()
        words = key.split()
        group = words[-1]
        if group == "hydra" or "override" in words or not (CONF / group).is_dir():
            continue
        options = ", ".join(sorted(p.stem for p in (CONF / group).glob("*.yaml")))
        lines.append(f"{group}: {options}")
    return "\n".join(lines) if lines else "(none: every key is set as KEY=VALUE)"
