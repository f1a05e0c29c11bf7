"""gpt-oss end to end: a tiny random gpt-oss checkpoint saved by transformers with a tiny harmony tokenizer beside it
(as the hub's directory holds both) fine-tuned by lora_single_device on chat data rendered in the harmony format."""

from tests._helpers.models import write_tiny_hf_model
from tests._helpers.recipes import losses, run_recipe_in_process, train_overrides, write_instruct_data
from tests._helpers.tokenizers import GPT_OSS_FIRST_SPECIAL, GPT_OSS_HUB_IDS, PHI4_BASE_VOCAB, write_tokenizer_files


def tiny_id(name: str) -> int:
    return PHI4_BASE_VOCAB + GPT_OSS_HUB_IDS[name] - GPT_OSS_FIRST_SPECIAL


def test_lora_run_on_harmony_chat_data_lowers_the_loss(tmp_path):
    """6 LoRA steps (batch 4, attention adapted) on instruction rows as harmony conversations: the loss falls by more
    than 0.5 nat (measured 6.299 -> 5.523). Rows are 256 tokens: the tiny BPE spends ~200 on the system message."""
    from mtune.tokenizers import Message, load_tokenizer

    vocab = write_tokenizer_files(tmp_path / "tok", "gpt_oss")
    # the hub's config.json: eos <|return|>, pad <|endoftext|>
    checkpoint = write_tiny_hf_model(tmp_path, "gpt_oss", vocab_size=vocab, bos_token_id=None,
                                     eos_token_id=tiny_id("<|return|>"), pad_token_id=tiny_id("<|endoftext|>"))
    write_tokenizer_files(checkpoint, "gpt_oss")
    tok = load_tokenizer(checkpoint)
    assert tok.family == "gpt_oss" and tok.vocab_size == vocab == 521
    sample = tok.tokenize_messages([Message("user", "reverse: red green blue"), Message("assistant", "blue green red")])
    assert len(sample.tokens) <= 256 and sample.tokens[-1] == tok.return_id and sample.trained[-1]
    data = write_instruct_data(tmp_path / "data.jsonl")
    out = run_recipe_in_process("lora_single_device", train_overrides(
        tmp_path, checkpoint, data, **{"tokenizer.max_seq_len": 256, "lora.modules": ["q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"]}))
    run = losses(out)
    assert len(run) == 6 and run[-1] < run[0] - 0.5, run
