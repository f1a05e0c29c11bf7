"""A config's ``messages`` as a chat: each malformed turn refused in one line naming it."""

import pytest

from mtune.config import ConfigError
from mtune.tokenizers import Message
from mtune.tokenizers.prompt import chat_messages


def test_chat_messages():
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat_messages(turns) == [Message("system", "be brief"), Message("user", "hi")]


@pytest.mark.parametrize("turn, message", [
    ({"role": "user"}, "messages[1]: expected {role: ..., content: ...}, got {'role': 'user'}"),
    ("hi", "messages[1]: expected {role: ..., content: ...}, got 'hi'"),
    ({"role": "bot", "content": "x"},
     "messages[1].role: 'bot' is not a chat role; use one of system, user, assistant, tool"),
    ({"role": "user", "content": 3}, "messages[1].content: expected text, got int 3 (quote it)"),
])
def test_malformed_turns_are_named(turn, message):
    with pytest.raises(ConfigError) as err:
        chat_messages([{"role": "user", "content": "ok"}, turn])
    assert str(err.value) == message
