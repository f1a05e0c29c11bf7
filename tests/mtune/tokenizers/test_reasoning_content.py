"""A reply's reasoning given apart from its content (``reasoning_content``, the field Qwen3's and Qwen3.5's templates
read; ``Message.thinking`` in mtune) against the official templates run by transformers' apply_chat_template:
Qwen/Qwen3-0.6B's and Qwen3.5's full templates (tests/assets/chat_templates) and Qwen3-8B's (tests/_helpers, which
tests the field with ``is string``). Ids equal transformers', and the trained mask equals the one read off the
template's own text (every token starting inside an assistant turn, after its ``<|im_start|>assistant\\n`` and up to
its ``<|im_end|>``). Cases: reasoning kept after the last user query and dropped before it, a reasoned tool call
(the interleaved thinking of agent data), an empty reasoning, whitespace around it (Qwen3 strips newlines, Qwen3.5
all whitespace), and a content that holds a ``<think>`` block too (the template then keeps the content as it is).

Mutations seen failing: the field ignored (the content always split: 12 tests); the content split even when the
field is given (the both-given case, 2 tests); the emptiness test of Qwen3's non-last replies made on the stripped
reasoning (the ``"\\n"`` case); Qwen3.5's reasoning stripped of newlines only (the whitespace case); Qwen3's reasoning
text not trained (the mask, 10 tests).
"""

import re

import pytest

from mtune.tokenizers import Message, load_tokenizer
from tests._helpers.tokenizers import write_qwen_tools_tokenizer
from tests._helpers.tool_calls import WEATHER, call

QUESTION = {"role": "user", "content": "what is 2 + 3?"}
TWO_TURNS = [QUESTION, {"role": "assistant", "content": "It's 5.", "reasoning_content": "add them"},
             {"role": "user", "content": "and 4 + 4?"},
             {"role": "assistant", "content": "It's 8.", "reasoning_content": "four and four"}]
TOOL_TURN = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
              "tool_calls": [call("get_weather", {"city": "Paris"})]},
             {"role": "tool", "content": "18 C"},
             {"role": "assistant", "content": "It is 18 C.", "reasoning_content": "\n"},
             {"role": "assistant", "content": "Anything else?", "reasoning_content": ""}]
SPACED = [QUESTION, {"role": "assistant", "content": " It's 5.", "reasoning_content": "\n  add them \n\n"}]
CASES = {"two_turns": (TWO_TURNS, None), "tool_turn": (TOOL_TURN, [WEATHER]), "spaced": (SPACED, None)}


@pytest.fixture(scope="module")
def pairs(tokenizer_dirs, hf_tokenizers, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("reasoning")
    out = {"qwen3-8b": (load_tokenizer(tokenizer_dirs["qwen3"]), hf_tokenizers["qwen3"])}
    for family in ("qwen3", "qwen3_5"):
        write_qwen_tools_tokenizer(root / family, family)
        out[family] = (load_tokenizer(root / family), AutoTokenizer.from_pretrained(root / family))
    return out


def template_ids_and_mask(hf, messages, tools):
    """The template's ids, and its trained mask read off its text: a token is trained when it starts inside an
    assistant turn's body (independent of mtune's renderer)."""
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False)
    bodies = [(m.end(), text.index("<|im_end|>", m.end()) + len("<|im_end|>"))
              for m in re.finditer(r"<\|im_start\|>assistant\n", text)]
    encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in bodies) for start, _ in encoded["offset_mapping"]]
    return encoded["input_ids"], mask


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("which", ["qwen3", "qwen3-8b", "qwen3_5"])
def test_reasoning_content_matches_the_template(which, case, pairs):
    if which == "qwen3-8b" and case == "tool_turn":
        pytest.skip("the Qwen3-8B template in tests/_helpers has its tool branches left out")
    tok, hf = pairs[which]
    messages, tools = CASES[case]
    result = tok.tokenize_messages(messages, tools=tools)
    ids, mask = template_ids_and_mask(hf, messages, tools)
    assert result.tokens == ids
    assert result.trained == mask
    # the field reaches Message.thinking; given as the Message, the same ids
    as_messages = [Message.from_dict(m) for m in messages]
    assert as_messages[1].thinking == messages[1]["reasoning_content"]
    assert tok.tokenize_messages(as_messages, tools=tools).tokens == ids


@pytest.mark.parametrize("which", ["qwen3", "qwen3_5"])
def test_the_field_and_a_think_block_in_the_content_agree(which, pairs):
    """The same reasoning given in the field or as a ``<think>`` block in the content renders the same."""
    tok, _ = pairs[which]
    in_block = [QUESTION, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt's 5."}]
    assert tok.tokenize_messages(in_block).tokens == tok.tokenize_messages(TWO_TURNS[:2]).tokens
    text = tok.decode(tok.tokenize_messages(in_block).tokens, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\nadd them\n</think>\n\nIt's 5.<|im_end|>\n")


@pytest.mark.parametrize("which", ["qwen3", "qwen3_5"])
def test_field_and_block_both_given_keeps_the_content_as_the_template_does(which, pairs):
    """With ``reasoning_content`` the template does not look for ``<think>`` in the content: the content's block is
    written after the field's. Same text as the template's; the content's tags are text in mtune (a message's
    spellings never become control tokens), the template's tokenizer would read them as the tag tokens."""
    tok, hf = pairs[which]
    both = [QUESTION, {"role": "assistant", "content": "<think>\nold\n</think>\n\nIt's 5.",
                       "reasoning_content": "new"}]
    result = tok.tokenize_messages(both)
    assert tok.decode(result.tokens, skip_special_tokens=False) == hf.apply_chat_template(both, tokenize=False)
    trained = tok.decode([t for t, keep in zip(result.tokens, result.trained) if keep], skip_special_tokens=False)
    assert trained == "<think>\nnew\n</think>\n\n<think>\nold\n</think>\n\nIt's 5.<|im_end|>"
