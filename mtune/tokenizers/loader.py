"""``load_tokenizer``: find a model's tokenizer files and pick the family that reads them.

A model directory's family comes from ``config.json``'s ``model_type``, then the files decide the variant:

==============  =====================================================================================
model_type      tokenizer
==============  =====================================================================================
llama           Llama 3 if ``original/tokenizer.model`` or ``tokenizer.model`` is a tiktoken rank file (or,
                with neither, a ``tokenizer.json`` holding ``<|begin_of_text|>``); Llama 2 if
                ``tokenizer.model`` is a sentencepiece model
mistral         Mistral v3 sentencepiece ``tokenizer.model`` (or ``tokenizer.model.v3``)
qwen2           Qwen2 / Qwen2.5 ``tokenizer.json``
qwen3           Qwen3 ``tokenizer.json`` (Qwen2's with ``<think>`` / ``</think>``)
qwen3_5(_moe)   Qwen3.5 ``tokenizer.json`` (Qwen3's ids, Qwen3.5's chat template: family ``qwen3_5``), ``_text``
                too
phi3            Phi-4 ``tokenizer.json`` holding ``<|im_sep|>`` (family ``phi4``), Phi-4-mini's holding
                ``<|assistant|>`` and ``<|end|>`` (family ``phi4_mini``); Phi-3 / Phi-3.5's (Llama 2's 32k
                vocabulary, ``<s>``) is refused
gemma3(_text)   Gemma 3 ``tokenizer.json`` (family ``gemma3``)
gemma4(_text)   Gemma 4 ``tokenizer.json`` (family ``gemma4``)
gpt_oss         gpt-oss ``tokenizer.json`` (o200k_harmony) and the harmony chat format (family ``gpt_oss``)
==============  =====================================================================================

Without ``config.json`` (or given a single file) the kind is inferred from the files themselves.
"""

from __future__ import annotations

from pathlib import Path

from mtune.errors import PathNotFoundError
from mtune.tokenizers.base import Tokenizer, TokenizerError, not_the_file, read_json

FAMILIES = ("llama2", "llama3", "mistral", "qwen2", "qwen3", "qwen3_5", "phi4", "phi4_mini", "gemma3", "gemma4",
            "gpt_oss")


def load_tokenizer(path: str | Path, max_seq_len: int | None = None, **options) -> Tokenizer:
    """The tokenizer of a model directory (as ``mtune download`` leaves it) or of one tokenizer file.

    ``max_seq_len`` becomes the default length limit of ``encode`` and ``tokenize_messages``. ``options`` are the
    family's own settings (e.g. gpt-oss's ``current_date`` and ``reasoning_effort``, Qwen3's ``enable_thinking``);
    one the family does not take is refused by name.
    """
    family, file = detect_tokenizer(path)
    if family == "llama3":
        from mtune.tokenizers.llama3 import Llama3Tokenizer as cls
    elif family == "llama2":
        from mtune.tokenizers.llama2 import Llama2Tokenizer as cls
    elif family == "mistral":
        from mtune.tokenizers.mistral import MistralTokenizer as cls
    elif family == "qwen3":
        from mtune.tokenizers.qwen3 import Qwen3Tokenizer as cls
    elif family == "qwen3_5":
        from mtune.tokenizers.qwen3_5 import Qwen3_5Tokenizer as cls
    elif family == "phi4":
        from mtune.tokenizers.phi4 import Phi4Tokenizer as cls
    elif family == "phi4_mini":
        from mtune.tokenizers.phi4 import Phi4MiniTokenizer as cls
    elif family == "gemma3":
        from mtune.tokenizers.gemma3 import Gemma3Tokenizer as cls
    elif family == "gemma4":
        from mtune.tokenizers.gemma4 import Gemma4Tokenizer as cls
    elif family == "gpt_oss":
        from mtune.tokenizers.gpt_oss import GptOssTokenizer as cls
    else:
        from mtune.tokenizers.qwen2 import Qwen2Tokenizer as cls
    if options:
        import inspect

        takes = [name for name in inspect.signature(cls.__init__).parameters if name not in ("self", "path",
                                                                                             "max_seq_len")]
        unknown = sorted(set(options) - set(takes))
        if unknown:
            raise TokenizerError(f"tokenizer option {', '.join(unknown)} does not apply to the {family} tokenizer; "
                                 f"it takes {', '.join(takes) or 'no options'}")
    return cls(file, max_seq_len=max_seq_len, **options)


def detect_tokenizer(path: str | Path) -> tuple[str, Path]:
    """(family, tokenizer file) for a model directory or a tokenizer file; see the module docstring."""
    if path is None:  # tokenizer.path: ${model.checkpoint_dir} with random weights (model.size) has nothing to read
        raise PathNotFoundError("tokenizer.path is not set (with model.size there is no checkpoint_dir to read it "
                                "from); set tokenizer.path to a model directory or a tokenizer file")
    path = Path(path).expanduser()
    if not path.exists():
        raise PathNotFoundError(f"tokenizer path {path} does not exist; set tokenizer.path to a model directory "
                                "or a tokenizer file")
    if path.is_file():
        return _family_of_file(path), path
    config = path / "config.json"
    model_type = read_json(config).get("model_type") if config.exists() else None
    if model_type is None:
        for name in ("original/tokenizer.model", "tokenizer.model", "tokenizer.model.v3", "tokenizer.json"):
            if (path / name).is_file():
                return _family_of_file(path / name), path / name
        raise PathNotFoundError(f"{path}: no config.json and no tokenizer.model / tokenizer.json; point "
                                "tokenizer.path at a Hugging Face model directory")
    if model_type == "llama":
        for name in ("original/tokenizer.model", "tokenizer.model"):
            file = path / name
            if file.is_file():
                from mtune.tokenizers.llama3 import is_tiktoken_file

                return ("llama3" if is_tiktoken_file(file) else "llama2"), file
        file = path / "tokenizer.json"
        if file.is_file() and _family_of_file(file) == "llama3":
            return "llama3", file
        raise PathNotFoundError(f"{path}: a llama model without original/tokenizer.model, tokenizer.model or a "
                                "Llama 3 tokenizer.json; download the tokenizer files with the weights")
    if model_type == "mistral":
        for name in ("tokenizer.model.v3", "tokenizer.model"):
            if (path / name).is_file():
                return "mistral", path / name
        raise PathNotFoundError(f"{path}: a mistral model without tokenizer.model; mtune reads Mistral's v3 "
                                "sentencepiece tokenizer.model (tekken tokenizers are not supported)")
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
        # Qwen3-MoE ships Qwen3's tokenizer; Qwen3.5 Qwen3's ids with its own chat template (docs/tokenizers.md)
        family = {"qwen3_moe": "qwen3", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5",
                  "qwen3_5_moe_text": "qwen3_5"}.get(model_type, model_type)
        if (path / "tokenizer.json").is_file():
            return family, path / "tokenizer.json"
        raise PathNotFoundError(f"{path}: a {model_type} model without tokenizer.json; download it with the weights")
    if model_type == "phi3":
        # Phi-4 and Phi-4-mini share the model type; the file tells them (and Phi-3's) apart
        if (path / "tokenizer.json").is_file():
            return _family_of_file(path / "tokenizer.json"), path / "tokenizer.json"
        raise PathNotFoundError(f"{path}: a phi3 model without tokenizer.json; download it with the weights")
    family = {"gemma3": "gemma3", "gemma3_text": "gemma3", "gemma4": "gemma4", "gemma4_text": "gemma4",
              "gpt_oss": "gpt_oss"}.get(model_type)
    if family is not None:
        if (path / "tokenizer.json").is_file():
            return family, path / "tokenizer.json"
        raise PathNotFoundError(f"{path}: a {model_type} model without tokenizer.json; download it with the weights")
    raise TokenizerError(f"{config}: model_type {model_type!r} has no mtune tokenizer; supported: llama, mistral, "
                         "qwen2, qwen3, qwen3_moe, qwen3_5, phi3, gemma3, gemma4, gpt_oss")


def _family_of_file(file: Path) -> str:
    if file.suffix == ".json":
        spec = read_json(file)
        added = {t.get("content") for t in spec.get("added_tokens") or []}
        if "<|im_sep|>" in added:
            return "phi4"
        if "<|assistant|>" in added and "<|end|>" in added and "<s>" in added:
            raise TokenizerError(f"{file}: a Phi-3 / Phi-3.5 tokenizer.json (Llama 2's vocabulary with <s>, "
                                 "newline-separated turns), which mtune does not read; it reads Phi-4's and "
                                 "Phi-4-mini's")
        if "<|im_start|>" in added:
            return "qwen3" if "</think>" in added else "qwen2"
        if "<|begin_of_text|>" in added:
            return "llama3"
        if {"<|start|>", "<|channel|>", "<|message|>"} <= added:
            return "gpt_oss"
        if "<|assistant|>" in added and "<|end|>" in added:
            return "phi4_mini"
        if "<start_of_turn>" in added:
            return "gemma3"
        if "<|turn>" in added:
            return "gemma4"
        raise TokenizerError(f"{file}: not a Qwen (<|im_start|>), Llama 3 (<|begin_of_text|>), gpt-oss (<|start|>, "
                             "<|channel|>, <|message|>), Phi-4 (<|im_sep|>), Phi-4-mini (<|assistant|>, <|end|>), "
                             "Gemma 3 (<start_of_turn>) or Gemma 4 (<|turn>) tokenizer.json")
    from mtune.tokenizers.llama3 import is_tiktoken_file

    if is_tiktoken_file(file):
        return "llama3"
    import sentencepiece

    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
    except (RuntimeError, OSError) as err:
        what = not_the_file(file) or f"neither a tiktoken rank file nor a sentencepiece model ({err})"
        raise TokenizerError(f"{file}: {what}") from None
    inst = sp.piece_to_id("[INST]")
    return "mistral" if sp.id_to_piece(inst) == "[INST]" and sp.is_control(inst) else "llama2"
