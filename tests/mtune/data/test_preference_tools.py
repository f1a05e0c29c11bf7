"""Preference pairs with tool calling: the two conversations share a ``tools`` column; each side's ids equal
transformers' apply_chat_template with Qwen3's official template (tests/assets/chat_templates/qwen3.jinja) on its
OpenAI-format conversation, and its labels are the last reply's tokens read off the template's text (after
``<|im_start|>assistant\\n``, up to its ``<|im_end|>``). Cases: whole OpenAI conversations sharing a call and its
result, differing in the answer; a call against a plain answer as the responses (OpenAI ``prompt`` list);
LLaMA-Factory's ShareGPT preference layout (``conversations`` as the prompt, ``chosen`` / ``rejected`` single messages,
a ``function_call`` against a ``gpt`` reply, bare definitions as JSON text). A family without tool calling refuses the
row, naming it.

Mutations seen failing: the tools not passed to the tokenizer (3 tests); the prompt rendered without the tools (its
generation prompt then no prefix of the conversation: earlier replies labelled, 1); an OpenAI message's tool_calls
dropped (2); a single-message dict refused as before (1); bare ShareGPT definitions not wrapped (1).
"""

import json

import pytest

from mtune.data import DataError, preference_dataset
from mtune.data.common import IGNORE_INDEX
from mtune.tokenizers import load_tokenizer
from tests._helpers.data import tiny_tokenizer, write_rows
from tests._helpers.tokenizers import write_qwen_tools_tokenizer
from tests._helpers.tool_calls import ONE_CALL, PARIS, QUESTION, WEATHER, call, template_ids_and_mask

ANSWER = {"role": "assistant", "content": "It is cold in Paris."}
SHARED_CALL = {"tools": [WEATHER], "chosen": ONE_CALL, "rejected": ONE_CALL[:-1] + [ANSWER]}
CALL_OR_ANSWER = {"tools": json.dumps([WEATHER]), "prompt": [QUESTION],
                  "chosen": [{"role": "assistant", "content": None, "tool_calls": [PARIS]}], "rejected": [ANSWER]}
LLAMA_FACTORY = {"tools": json.dumps([WEATHER["function"]]),
                 "conversations": [{"from": "human", "value": QUESTION["content"]}],
                 "chosen": {"from": "function_call", "value": json.dumps(PARIS["function"])},
                 "rejected": {"from": "gpt", "value": ANSWER["content"]}}
CASES = {  # row, column_map, each side's OpenAI conversation
    "shared_call": (SHARED_CALL, None, {"chosen": ONE_CALL, "rejected": ONE_CALL[:-1] + [ANSWER]}),
    "call_or_answer": (CALL_OR_ANSWER, None, {"chosen": [QUESTION, CALL_OR_ANSWER["chosen"][0] | {"content": ""}],
                                              "rejected": [QUESTION, ANSWER]}),
    "llama_factory": (LLAMA_FACTORY, {"prompt": "conversations"},
                      {"chosen": [QUESTION, {"role": "assistant", "content": "", "tool_calls": [PARIS]}],
                       "rejected": [QUESTION, ANSWER]}),
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("qwen3_tools")
    write_qwen_tools_tokenizer(path, "qwen3")
    return load_tokenizer(path), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tool_pairs_equal_the_template_and_label_the_last_reply(case, qwen3, tmp_path):
    tok, hf = qwen3
    row, column_map, conversations = CASES[case]
    pair = preference_dataset(tok, str(write_rows([row], tmp_path / "pairs.jsonl")), column_map=column_map)[0]
    for side, messages in conversations.items():
        ids, mask = template_ids_and_mask(hf, messages, [WEATHER], "<|im_start|>assistant\n", "<|im_end|>",
                                          last_reply_only=True)
        assert pair[side]["tokens"] == ids
        assert [False] + [label != IGNORE_INDEX for label in pair[side]["labels"][:-1]] == mask
    if case != "shared_call":  # the chosen response is the call itself
        labelled = [t for t, label in zip(pair["chosen"]["tokens"][1:], pair["chosen"]["labels"]) if label != -100]
        assert "<tool_call>" in tok.decode(labelled, skip_special_tokens=False)


def test_gpt_oss_labels_the_last_reply_when_its_prompt_renders_otherwise(tmp_path):
    """Without the answer, gpt-oss's template keeps a call's reasoning as an analysis message (no final answer follows
    it), so the prompt is no prefix of the conversation: the reply is then found as the last run of trained tokens
    (mutation seen failing: the whole conversation's trained tokens labelled, the earlier call included)."""
    tok = tiny_tokenizer(tmp_path, "gpt_oss", max_seq_len=None)
    prefix = [QUESTION, {"role": "assistant", "content": "", "thinking": "need the weather", "tool_calls": [PARIS]},
              {"role": "tool", "content": "18"}]
    row = {"tools": [WEATHER], "prompt": prefix, "chosen": "It is 18 C.", "rejected": "It is cold."}
    pair = preference_dataset(tok, str(write_rows([row], tmp_path / "pairs.jsonl")))[0]
    for side, answer in (("chosen", "It is 18 C."), ("rejected", "It is cold.")):
        tokens, labels = pair[side]["tokens"], pair[side]["labels"]
        conversation = prefix + [{"role": "assistant", "content": answer}]
        assert tokens == tok.tokenize_messages(conversation, tools=[WEATHER]).tokens
        labelled = [t for t, label in zip(tokens[1:], labels) if label != IGNORE_INDEX]
        assert tok.decode(labelled, skip_special_tokens=False) == f"<|channel|>final<|message|>{answer}<|return|>"


def test_a_family_without_tool_calling_refuses_the_pair(tmp_path):
    with pytest.raises(DataError, match=r"pairs\.jsonl line 1: phi4_mini chat format: the conversation uses tool calling"):
        preference_dataset(tiny_tokenizer(tmp_path, "phi4_mini"), str(write_rows([SHARED_CALL], tmp_path / "pairs.jsonl")))


def test_two_calls_with_the_same_empty_text_are_a_pair(qwen3, tmp_path):
    """Responses are compared whole: two calls of different arguments (both with empty text) are not "identical"."""
    tok, hf = qwen3
    oslo = {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Oslo"})]}
    row = dict(CALL_OR_ANSWER, rejected=[oslo])
    pair = preference_dataset(tok, str(write_rows([row], tmp_path / "pairs.jsonl")))[0]
    ids, _ = template_ids_and_mask(hf, [QUESTION, oslo | {"content": ""}], [WEATHER], "<|im_start|>assistant\n",
                                   "<|im_end|>", last_reply_only=True)
    assert pair["rejected"]["tokens"] == ids != pair["chosen"]["tokens"]
