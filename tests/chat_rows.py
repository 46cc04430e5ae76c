"""Chat rows the chat tests share: a function tool in OpenAI's shape and a call of it, as a row holds them
(``arguments`` a JSON string)."""

from __future__ import annotations

from typing import Any

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL: dict[str, Any] = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
