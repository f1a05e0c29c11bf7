"""Tool-calling conversations for tests, in the OpenAI / Hugging Face messages format (the row format of
``mtune.data.chat_dataset`` with a ``tools`` column)."""

from __future__ import annotations

import json
from pathlib import Path


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
        "required": ["city"]}}}

# A tool whose parameters use what gpt-oss's TypeScript rendering distinguishes: descriptions, optional fields and
# defaults, enums, arrays of scalars / of arrays / of objects, nested objects (with a nullable field), a list of types,
# oneOf variants with a description and a default, and a schema with no type.
SEARCH = {"type": "function", "function": {
    "name": "search_flights", "description": "Finds flights.",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "description": "IATA code."},
        "cabin": {"type": "string", "enum": ["economy", "business"], "default": "economy"},
        "max_stops": {"type": "integer", "default": 1},
        "airlines": {"type": "array", "items": {"type": "string"}, "description": "Allowed airlines."},
        "seats": {"type": "array", "items": {"type": "integer"}},
        "legs": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
        "passengers": {"type": "array", "items": {"type": "object", "properties": {
            "age": {"type": "integer"}, "name": {"type": "string"}}, "required": ["age"]}},
        "filters": {"type": "object", "properties": {
            "refundable": {"type": "boolean"},
            "window": {"type": "object", "properties": {"earliest": {"type": "string", "nullable": True}}}},
            "required": ["refundable"]},
        "date": {"type": ["string", "null"]},
        "budget": {"oneOf": [{"type": "number", "description": "in euros"}, {"type": "string", "default": "any"}]},
        "notes": {}},
        "required": ["origin", "passengers"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time now."}}
TOOLS = [WEATHER, SEARCH, CLOCK]

SYSTEM = {"role": "system", "content": "Answer with the tools' data."}
QUESTION = {"role": "user", "content": "What's the weather in Paris?"}
PARIS = call("get_weather", {"city": "Paris", "unit": "celsius"})
ONE_CALL = [SYSTEM, QUESTION,
            {"role": "assistant", "content": "", "tool_calls": [PARIS]},
            {"role": "tool", "content": '{"temperature": 18, "sky": "sunny"}', "name": "get_weather"},
            {"role": "assistant", "content": "It is 18 °C and sunny in Paris."}]
# Two calls in one assistant message, answered by two tool messages in a row (Qwen3 / Qwen3.5).
PARALLEL = [QUESTION | {"content": "Weather in Paris and in Oslo?"},
            {"role": "assistant", "content": "I'll check both.",
             "tool_calls": [PARIS, call("get_weather", {"city": "Oslo"})]},
            {"role": "tool", "content": "18 °C"}, {"role": "tool", "content": "9 °C"},
            {"role": "assistant", "content": "Paris 18 °C, Oslo 9 °C."}]
# The same two calls as harmony writes them: one per assistant message, each followed by its result (gpt-oss).
SEQUENTIAL = [PARALLEL[0],
              {"role": "assistant", "content": "", "tool_calls": [PARIS]}, {"role": "tool", "content": "18 °C"},
              {"role": "assistant", "content": "", "thinking": "now Oslo",
               "tool_calls": [call("get_weather", {"city": "Oslo"})]}, {"role": "tool", "content": "9 °C"},
              {"role": "assistant", "content": "Paris 18 °C, Oslo 9 °C."}]
NESTED_ARGUMENTS = {"origin": "CDG", "passengers": [{"age": 34, "name": "Ana"}], "filters": {"refundable": True},
                    "max_stops": 0, "budget": 250.5, "date": None}
NESTED = [QUESTION | {"content": "A refundable flight from CDG for Ana, 34?"},
          {"role": "assistant", "content": "", "tool_calls": [call("search_flights", NESTED_ARGUMENTS)]},
          {"role": "tool", "content": "AF 123, 250 EUR"}, {"role": "assistant", "content": "AF 123 for 250 EUR."}]


def with_string_arguments(messages: list[dict]) -> list[dict]:
    """``messages`` with every call's arguments given as JSON text (compact, unlike the templates' ``tojson``)."""
    out = []
    for message in messages:
        if "tool_calls" in message:
            calls = [call(c["function"]["name"], json.dumps(c["function"]["arguments"], separators=(",", ":")))
                     for c in message["tool_calls"]]
            message = message | {"tool_calls": calls}
        out.append(message)
    return out


def write_tool_calling_rows(path: str | Path, n_rows: int = 8) -> Path:
    """A JSON Lines file of ``n_rows`` tool-calling conversations (``tools`` and ``messages`` columns), one city
    each, for a chat_dataset run."""
    cities = ["Paris", "Oslo", "Rome", "Lima", "Kyiv", "Oran", "Bern", "Riga"]
    rows = []
    for i in range(n_rows):
        city = cities[i % len(cities)]
        rows.append({"tools": [WEATHER], "messages": [
            {"role": "user", "content": f"What's the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": city})]},
            {"role": "tool", "content": json.dumps({"temperature_c": 10 + i})},
            {"role": "assistant", "content": f"It is {10 + i} degrees in {city}."}]})
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def template_ids_and_mask(hf, messages: list[dict], tools, reply_open: str, reply_close: str,
                          last_reply_only: bool = False, **kwargs):
    """The ids transformers' ``apply_chat_template(messages, tools=tools, **kwargs)`` gives, and the trained mask read
    off the template's text, independently of mtune's renderer: a token is trained when it starts inside a reply,
    after a ``reply_open`` (e.g. ``<|im_start|>assistant\\n``) and up to the ``reply_close`` after it, included
    (with ``last_reply_only``, the last reply's tokens only, as preference pairs train)."""
    import re

    text = hf.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    replies = [(m.end(), text.find(reply_close, m.end()) + len(reply_close))
               for m in re.finditer(re.escape(reply_open), text)]
    replies = replies[-1:] if last_reply_only else replies
    encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in replies if b > a) for start, _ in encoded["offset_mapping"]]
    return encoded["input_ids"], mask
