"""mtune's config system: YAML + overrides (omegaconf), `instantiate`, key declarations and validation.

Imports omegaconf and PyYAML only, never torch, so the CLI's light commands stay fast.
"""

from mtune.config.errors import ComponentError, ConfigError
from mtune.config.instantiate import call_component, instantiate, resolve_component
from mtune.config.loading import apply_overrides, load_config, parse_value
from mtune.config.schema import REQUIRED, Key, KeyGroup, Node, RecipeSchema, render_help, render_markdown
from mtune.config.validate import ValidationReport, validate_config

__all__ = [
    "REQUIRED",
    "ComponentError",
    "ConfigError",
    "Key",
    "KeyGroup",
    "Node",
    "RecipeSchema",
    "ValidationReport",
    "apply_overrides",
    "call_component",
    "instantiate",
    "load_config",
    "parse_value",
    "render_help",
    "render_markdown",
    "resolve_component",
    "validate_config",
]
