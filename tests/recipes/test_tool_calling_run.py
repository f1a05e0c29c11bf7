"""Tool calling end to end: a tiny random Qwen3 checkpoint saved by transformers, with a tiny tokenizer.json that has
Qwen3's tool tags as tokens and Qwen3's full chat template beside it, fine-tuned by lora_single_device on
tool-calling rows (a `tools` column; a call, its result and the answer) through mtune.data.chat_dataset."""

import json

from tests._helpers.models import write_tiny_hf_model
from tests._helpers.recipes import losses, run_recipe_in_process, train_overrides
from tests._helpers.tokenizers import write_qwen_tools_tokenizer
from tests._helpers.tool_calls import write_tool_calling_rows


def test_lora_run_on_tool_calling_rows_lowers_the_loss(tmp_path):
    """4 LoRA steps (batch 2) on 8 rows of ~640 tokens (the tiny BPE spends ~500 on the tools block of the system
    message): the loss falls by more than 0.5 nat (measured 6.300 -> 5.530), and a row's sample trains its call (the
    <tool_call> token included) and the answer, not the tool definitions or the tool's result."""
    from mtune.data import IGNORE_INDEX, chat_dataset
    from mtune.tokenizers import load_tokenizer

    checkpoint = write_tiny_hf_model(tmp_path, "qwen3", vocab_size=509)
    write_qwen_tools_tokenizer(checkpoint, "qwen3")
    data = write_tool_calling_rows(tmp_path / "tools.jsonl", n_rows=8)
    tok = load_tokenizer(checkpoint, max_seq_len=704)
    sample = chat_dataset(tok, str(data), cache=False)[0]
    trained = tok.decode([t for t, label in zip(sample["tokens"][1:], sample["labels"]) if label != IGNORE_INDEX],
                         skip_special_tokens=False)
    row = json.loads(data.read_text().splitlines()[0])
    assert trained == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
                       "<think>\n\n</think>\n\nIt is 10 degrees in Paris.<|im_end|>")
    assert len(sample["tokens"]) <= 704 and row["messages"][2]["content"] not in trained and "<tools>" not in trained
    assert tok._tag_ids["<tool_call>"] in sample["tokens"]
    out = run_recipe_in_process("lora_single_device", train_overrides(tmp_path, checkpoint, data, **{
        "dataset._component_": "mtune.data.chat_dataset", "tokenizer.max_seq_len": 704, "batch_size": 2,
        "max_steps_per_epoch": 4}))
    run = losses(out)
    assert len(run) == 4 and run[-1] < run[0] - 0.5, run
