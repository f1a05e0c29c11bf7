"""gpt-oss's tool definitions: the TypeScript-like ``namespace functions`` block its chat template writes into the
developer message (the template's ``render_tool_namespace`` and ``render_typescript_type`` macros)::

    ## functions

    namespace functions {

    // Gets the weather.
    type get_weather = (_: {
    // The city.
    city: string,
    unit?: "celsius" | "fahrenheit", // default: celsius
    }) => any;

    } // namespace functions

JSON-schema types map to TypeScript: string (an ``enum`` gives its values as string literals, ``nullable`` adds
``| null``), number / integer -> number, boolean, arrays (``string[]``, ``number[]``, ``boolean[]``, an item type of
its own, or ``any[]`` when that is longer than 50 characters), objects (``{\\n`` then ``name?: type`` pairs; ``?``
marks a property not in ``required``), a list of types joined with ``|``, ``oneOf`` variants, anything else
``any``. The template's whitespace is kept as it comes out of transformers' Jinja (trim_blocks, lstrip_blocks),
quirks included: a nested object's property types follow a newline and 16 spaces, ``oneOf`` variants are joined by
``" | \\n"``, and its check for object variants never takes effect (the flag is set inside a loop, which Jinja
scopes to the loop).
"""

from __future__ import annotations

from typing import Any

from mtune.tokenizers.tools import tojson

NESTED_TYPE_PREFIX = "\n" + " " * 16  # the text before a nested property's type: a `{{ ... }}` without its '-'
ONE_OF_DEFAULT_PREFIX = " " * 20  # the indentation kept before a oneOf variant's default comment, likewise
SCALAR_ARRAYS = {"string": "string[]", "number": "number[]", "integer": "number[]", "boolean": "boolean[]"}


def _concat(text: Any, what: str) -> str:
    """The template joins these with ``+``, which only takes text."""
    if not isinstance(text, str):
        raise ValueError(f"gpt_oss chat format: {what} must be text, got {type(text).__name__}")
    return text


def typescript_type(spec: Any) -> str:
    """The TypeScript type of one JSON-schema ``spec`` (a dict), as ``render_typescript_type`` writes it."""
    spec = spec if isinstance(spec, dict) else {}
    kind = spec.get("type")
    nullable = " | null" if spec.get("nullable") else ""
    if kind == "array":
        if "items" not in spec:
            return "any[]" + nullable
        items = spec["items"] if isinstance(spec["items"], dict) else {}
        item_kind = items.get("type")
        if isinstance(item_kind, str) and item_kind in SCALAR_ARRAYS:
            return SCALAR_ARRAYS[item_kind] + nullable
        inner = typescript_type(items)
        return ("any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]") + nullable
    if isinstance(kind, (list, tuple)) and kind:
        return " | ".join(str(k) for k in kind)
    if spec.get("oneOf"):
        variants = spec["oneOf"]
        out = ""
        for i, variant in enumerate(variants):
            variant = variant if isinstance(variant, dict) else {}
            out += typescript_type(variant)
            if variant.get("description"):
                out += "// " + _concat(variant["description"], "a oneOf variant's description")
            if "default" in variant:
                out += ONE_OF_DEFAULT_PREFIX + "// default: " + tojson(variant["default"])
            if i < len(variants) - 1:
                out += " | \n"
        return out
    if kind == "string":
        if spec.get("enum"):
            return '"' + '" | "'.join(str(v) for v in spec["enum"]) + '"'
        return "string" + nullable
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "object":
        properties = spec.get("properties")
        if not properties:
            return "object"
        required = spec.get("required") or []
        fields = [f"{name}{'' if name in required else '?'}: {NESTED_TYPE_PREFIX}{typescript_type(prop)}"
                  for name, prop in properties.items()]
        return "{\n" + ", ".join(fields) + "}"
    return "any"


def tool_namespace(tools: list[dict]) -> str:
    """The ``## functions`` block of the developer message for ``tools`` (OpenAI-format definitions; each needs a
    ``description``, which the template writes as a comment)."""
    out = "## functions\n\nnamespace functions {\n\n"
    for tool in tools:
        function = tool["function"]
        name = function["name"]
        if "description" not in function:
            raise ValueError(f"gpt_oss chat format: tool {name!r} has no description, which gpt-oss's template "
                             "writes above its type (give one, even a short one)")
        out += "// " + _concat(function["description"], f"tool {name!r}'s description") + "\n"
        out += "type " + name + " = "
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties")
        if not properties:
            out += "() => any;\n\n"
            continue
        required = parameters.get("required") or []
        out += "(_: {\n"
        for param, spec in properties.items():
            spec = spec if isinstance(spec, dict) else {}
            if spec.get("description"):
                out += "// " + _concat(spec["description"], f"parameter {param!r}'s description") + "\n"
            out += param + ("" if param in required else "?") + ": " + typescript_type(spec)
            if "default" in spec:
                if spec.get("enum"):
                    out += ", // default: " + _concat(spec["default"], f"parameter {param!r}'s enum default")
                elif spec.get("oneOf"):
                    out += "// default: " + _concat(spec["default"], f"parameter {param!r}'s oneOf default")
                else:
                    out += ", // default: " + tojson(spec["default"])
            out += ",\n"
        out += "}) => any;\n\n"
    return out + "} // namespace functions"
