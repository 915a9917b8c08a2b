"""Translate the resolved trainer config between its artifact form (a plain dict) and PPOConfig."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf_core.config import ConfigError, PPOConfig, all_keys, apply_overrides, validate_config


def config_from_dict(tree: Mapping[str, Any]) -> PPOConfig:
    """The PPOConfig of a ``PPOConfig.to_dict()`` tree (keys it lacks keep their defaults), validated."""
    items = []
    for key in all_keys():
        node: Any = tree
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            items.append((key, node))
    cfg, errors = PPOConfig(), []
    apply_overrides(cfg, items, lambda _notice: None, errors)
    if errors:
        raise ConfigError(errors)
    validate_config(cfg)
    return cfg
