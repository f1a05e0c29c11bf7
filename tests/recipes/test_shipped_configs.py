"""Every config under recipes/configs/: names an existing recipe, validates against that recipe's SCHEMA, writes out
every key the recipe reads, builds its model on the meta device with the published parameter count (and PEFT's
adapter count for LoRA), and is listed by `mtune ls` under its recipe. No weights are downloaded or read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtune._cli.catalog import builtin_configs, builtin_recipes, load_recipe_module
from mtune.config import load_config, validate_config
from mtune.training.memory.registry import MemoryConfig
from mtune.models import model_args
from mtune.modules.expert_linear import ExpertLinear
from mtune.modules.lora import LoRALinear, is_adapter_param
from mtune.modules.nf4_linear import FrozenNF4Linear
from mtune.training.model_setup import ModelSource, setup_model

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
CONFIGS = builtin_configs(RECIPES)

# Checkpoint directory name -> what its config.json says (family, mtune size), the published parameter count, and
# (Qwen3: the exact count of the hub config.json, which transformers builds too; its cards round it to 0.6B-32.8B),
# the trainable count PEFT reports for rank-8 LoRA on q/k/v/o/gate/up/down (get_peft_model on transformers' meta
# model of the same config.json; Llama 3.1 8B's 20,971,520 is also the figure PEFT prints in its own examples).
CHECKPOINTS = {
    "Llama-3.2-1B-Instruct": ("llama3_2", "1B", 1_235_814_400, 5_636_096),
    "Llama-3.2-3B-Instruct": ("llama3_2", "3B", 3_212_749_824, 12_156_928),
    "Llama-3.1-8B-Instruct": ("llama3_1", "8B", 8_030_261_248, 20_971_520),
    "Llama-3.1-70B-Instruct": ("llama3_1", "70B", 70_553_706_496, 103_546_880),
    "Qwen2.5-0.5B-Instruct": ("qwen2_5", "0.5B", 494_032_768, 4_399_104),
    "Qwen2.5-1.5B-Instruct": ("qwen2_5", "1.5B", 1_543_714_304, 9_232_384),
    "Qwen2.5-7B-Instruct": ("qwen2_5", "7B", 7_615_616_512, 20_185_088),
    "Mistral-7B-Instruct-v0.3": ("mistral", "7B-v0.3", 7_248_023_552, 20_971_520),
    "Llama-2-7b-chat-hf": ("llama2", "7B", 6_738_415_616, 19_988_480),
    "Qwen3-0.6B": ("qwen3", "0.6B", 596_049_920, 5_046_272),
    "Qwen3-1.7B": ("qwen3", "1.7B", 1_720_574_976, 8_716_288),
    "Qwen3-4B": ("qwen3", "4B", 4_022_468_096, 16_515_072),
    "Qwen3-8B": ("qwen3", "8B", 8_190_735_360, 21_823_488),
    "Qwen3-14B": ("qwen3", "14B", 14_768_307_200, 32_112_640),
    "Qwen3-32B": ("qwen3", "32B", 32_762_123_264, 67_108_864),
    # Phi-4-mini and Phi-4 (14B): rank-8 LoRA on their fused qkv_proj / gate_up_proj and o_proj / down_proj
    "Phi-4-mini-instruct": ("phi4", "mini", 3_836_021_760, 11_534_336),
    "phi-4": ("phi4", "14B", 14_659_507_200, 27_852_800),
    # Gemma 3: 1B is text-only; 4B-27B count their text tower (what mtune loads and trains), as transformers'
    # Gemma3ForCausalLM does from the text config
    "gemma-3-1b-it": ("gemma3", "1B", 999_885_952, 6_522_880),
    "gemma-3-4b-it": ("gemma3", "4B", 3_880_263_168, 14_901_248),
    "gemma-3-12b-it": ("gemma3", "12B", 11_766_034_176, 32_735_232),
    "gemma-3-27b-it": ("gemma3", "27B", 27_009_346_304, 56_758_272),
    # Qwen3.5's text models (the multimodal checkpoints' language model); PEFT's counts from get_peft_model on
    # transformers' Qwen3_5ForCausalLM (meta) with the configs' ten target modules
    "Qwen3.5-0.8B": ("qwen3_5", "0.8B", 752_393_024, 5_111_808),
    "Qwen3.5-2B": ("qwen3_5", "2B", 1_881_825_088, 7_815_168),
    "Qwen3.5-4B": ("qwen3_5", "4B", 4_205_751_296, 15_237_120),
    "Qwen3.5-9B": ("qwen3_5", "9B", 8_953_803_264, 20_054_016),
    "Qwen3.5-27B": ("qwen3_5", "27B", 26_895_998_464, 54_394_880),
    # Qwen3.5-MoE: rank-8 LoRA on the attention and DeltaNet linears (PEFT on transformers' meta
    # Qwen3_5MoeForCausalLM of the default text config, 35B-A3B's)
    "Qwen3.5-35B-A3B": ("qwen3_5", "35B_A3B", 34_660_610_688, 7_127_040),
    "Qwen3.5-122B-A10B": ("qwen3_5", "122B_A10B", 122_111_526_912, 14_548_992),  # its hub text config
    # Gemma 4's text models (one frozen scalar a layer beside transformers' count; per-layer input tables included);
    # PEFT's count from get_peft_model on transformers' Gemma4ForCausalLM (meta) of the same text config
    "gemma-4-E2B-it": ("gemma4", "E2B", 4_628_569_379, 12_079_104),
    "gemma-4-E4B-it": ("gemma4", "E4B", 7_463_013_418, 17_440_768),
    "gemma-4-31B-it": ("gemma4", "31B", 30_697_345_340, 61_214_720),
    # 26B-A4B: rank-8 LoRA on attention only (the global layers have no v_proj: keys as values)
    "gemma-4-26B-A4B-it": ("gemma4", "26B_A4B", 25_233_141_790, 5_744_640),
    # Qwen3-MoE: rank-8 LoRA on attention only (PEFT on transformers' meta model of the hub config.json)
    "Qwen3-30B-A3B": ("qwen3_moe", "30B_A3B", 30_532_122_624, 6_684_672),
    # gpt-oss (bf16 copies of the hub's MXFP4 checkpoints): rank-8 LoRA on attention only (PEFT on transformers'
    # meta model of the same config)
    "gpt-oss-20b-BF16": ("gpt_oss", "20B", 20_914_757_184, 3_981_312),
    "gpt-oss-120b-BF16": ("gpt_oss", "120B", 116_829_156_672, 5_971_968),
}
# else the seven of Llama's block
ADAPTED = {"phi4": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
           "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "qwen3_5": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj",
                       "up_proj", "down_proj"],
           "qwen3_5/35B_A3B": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"],
           "qwen3_5/122B_A10B": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"],
           "gemma4/26B_A4B": ["q_proj", "k_proj", "v_proj", "o_proj"]}

SINGLE_DEVICE_SIZES = {"llama3_2": ["1B", "3B"], "llama3_1": ["8B"], "qwen2_5": ["0.5B", "1.5B", "7B"],
                       "mistral": ["7B"], "llama2": ["7B"]}
LOW_MEMORY = {"llama3_1": "8B", "qwen2_5": "7B", "mistral": "7B", "llama2": "7B", "qwen3": "8B"}
PREFERENCE = {"llama3_1/8B_lora_dpo_single_device", "llama3_1/8B_full_dpo_distributed",
              "qwen3/8B_lora_dpo_single_device", "tiny/lora_dpo_single_device", "tiny/full_dpo_single_device",
              "tiny/lora_dpo_distributed", "tiny/full_dpo_distributed"}
DISTRIBUTED = {"llama3_1/8B_full_distributed", "llama3_1/8B_lora_distributed", "llama3_1/70B_lora_distributed",
               "llama3_1/70B_qlora_distributed", "qwen2_5/7B_lora_distributed", "qwen3/32B_lora_distributed",
               "qwen3_moe/30B_A3B_lora_distributed", "qwen3_5/122B_A10B_lora_distributed"}
ADAPTER_ONLY_SIZES = {"qwen3": ["0.6B", "1.7B", "4B", "8B", "14B", "32B"],  # LoRA and QLoRA only
                      "gemma3": ["1B", "4B", "12B", "27B"],  # LoRA and QLoRA, no full single-device
                      "qwen3_moe": ["30B_A3B"], "gemma4": ["E2B", "E4B", "31B"],
                      "qwen3_5": ["0.8B", "2B", "4B", "9B", "27B", "35B_A3B"], "phi4": ["14B"]}
EXPECTED = (
    {f"{family}/{size}_{method}_single_device" for family, sizes in SINGLE_DEVICE_SIZES.items() for size in sizes
     for method in ("full", "lora", "qlora")}
    | {f"{family}/{size}_{method}_single_device" for family, sizes in ADAPTER_ONLY_SIZES.items() for size in sizes
       for method in ("lora", "qlora")}
    | {f"{family}/{size}_full_single_device_low_memory" for family, size in LOW_MEMORY.items()}
    | DISTRIBUTED
    | PREFERENCE
    | {"phi4/mini_lora_single_device", "gemma4/26B_A4B_qlora_single_device"}
)
TRAINING_RECIPES = {"full_single_device", "lora_single_device", "full_distributed", "lora_distributed",
                    "lora_dpo_single_device", "full_dpo_single_device", "lora_dpo_distributed", "full_dpo_distributed"}

# Where the shipped configs put a user's runs (this test only reads the text; nothing is written there).
USER_RUNS = Path("/tmp") / "mtune"


def size_and_method(file: str) -> tuple[str, str]:
    """``8B_lora_single_device`` -> ``("8B", "lora")``; sizes may hold an underscore (``30B_A3B_qlora_...``)."""
    size, method = re.match(r"(.+?)_(full|lora|qlora|dora)(?:_|$)", file).groups()
    return size, method


@pytest.fixture(scope="module")
def loaded():
    """name -> (config, its recipe's SCHEMA) for every shipped config."""
    recipes = builtin_recipes(RECIPES)
    modules = {}
    out = {}
    for name, path in CONFIGS.items():
        cfg = load_config(path)
        recipe = cfg.get("recipe")
        assert recipe in recipes, f"{name}: recipe {recipe!r} does not exist"
        modules.setdefault(recipe, load_recipe_module(recipes[recipe]))
        out[name] = (cfg, modules[recipe].SCHEMA)
    return out


def test_expected_configs_are_shipped():
    assert EXPECTED <= set(CONFIGS), sorted(EXPECTED - set(CONFIGS))


def test_every_config_validates_against_its_recipe(loaded):
    for name, (cfg, schema) in loaded.items():
        report = validate_config(cfg, schema)
        assert report.errors == [], f"{name}: {report.errors}"
        assert all("path does not exist" in w for w in report.warnings), f"{name}: {report.warnings}"


def test_shipped_training_configs_spell_out_every_key(loaded):
    """Like the tiny template: every key the recipe reads is written out, and header, paths and names agree."""
    for name, (cfg, schema) in loaded.items():
        family, file = name.split("/")
        if family == "tiny" or cfg.recipe not in TRAINING_RECIPES:
            continue
        assert set(schema.keys) <= set(cfg.keys()), f"{name}: missing {sorted(set(schema.keys) - set(cfg.keys()))}"
        assert set(cfg.keys()) <= set(schema.keys), f"{name}: unknown {sorted(set(cfg.keys()) - set(schema.keys))}"
        text = CONFIGS[name].read_text()
        repo_name = Path(cfg.model.checkpoint_dir).name
        assert re.search(rf"mtune download \S+/{re.escape(repo_name)} --output-dir /tmp/{re.escape(repo_name)}", text)
        assert re.search(rf"mtune run (--nproc_per_node \d+ )?{cfg.recipe} --config {re.escape(name)}\n", text), name
        assert re.search(r"fits (an? \d+ GB GPU|\d+ x \d+ GB GPUs)", text), f"{name}: no memory target in the header"
        assert cfg.output_dir == str(USER_RUNS / f"{family}_{file}")
        assert cfg.dtype == "bf16" and cfg.tokenizer.path == cfg.model.checkpoint_dir
        assert ("lora" in cfg) == cfg.recipe.startswith("lora")
        assert size_and_method(file)[1] == ("qlora" if cfg.get("lora", {}).get("quantize_base") else
                                      "lora" if "lora" in cfg else "full")
        if file.endswith("_low_memory"):
            assert cfg.optimizer._component_ == "bitsandbytes.optim.PagedAdamW8bit" and cfg.optimizer_in_bwd
            assert cfg.enable_activation_checkpointing and cfg.clip_grad_norm is None
            assert cfg.gradient_accumulation_steps == 1


def test_models_build_on_meta_with_published_sizes(loaded):
    """The model each config names, built on meta with its LoRA / NF4 settings: published base count, PEFT's
    adapter count, only adapters trainable, NF4 on every frozen block linear for QLoRA."""
    for name, (cfg, _) in loaded.items():
        family, file = name.split("/")
        if family == "tiny" or cfg.recipe not in TRAINING_RECIPES:
            continue
        ckpt_family, size, published, peft_trainable = CHECKPOINTS[Path(cfg.model.checkpoint_dir).name]
        assert (ckpt_family, size.split("-")[0]) == (family, size_and_method(file)[0]), name
        source = ModelSource(ckpt_family, model_args(ckpt_family, size), None)
        lora = cfg.get("lora")
        model, _ = setup_model(source, device=torch.device("meta"), dtype=torch.bfloat16, lora=lora,
                               materialize=False, memory=MemoryConfig.from_config(cfg))
        params = dict(model.named_parameters())
        base = sum(p.numel() for n, p in params.items() if not is_adapter_param(n))
        trainable = sum(p.numel() for p in params.values() if p.requires_grad)
        assert base == published, f"{name}: {base:,} parameters, published {published:,}"
        if lora is None:
            assert trainable == published, name
            continue
        seven = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        adapted = ADAPTED.get(f"{family}/{size}", ADAPTED.get(family, seven))
        assert (lora.rank, list(lora.modules), lora.use_dora) == (8, adapted, False)
        assert trainable == peft_trainable, f"{name}: {trainable:,} trainable, PEFT {peft_trainable:,}"
        kept = {f"{n}.{child}" for n, m in model.named_modules() for child in getattr(m, "kept_in_model_dtype", ())}
        # Gemma 4's per-layer-input branch: not among the seven targets, frozen (NF4 under QLoRA)
        per_layer = {n for n, _ in model.named_modules()
                     if n.endswith(("per_layer_input_gate", "per_layer_projection"))}
        frozen_type = FrozenNF4Linear if lora.quantize_base else torch.nn.Linear
        assert all(type(model.get_submodule(n)) is frozen_type for n in per_layer), name
        block_linears = [m for n, m in model.named_modules() if n.startswith("layers.") and n not in kept | per_layer
                         and isinstance(m, torch.nn.Linear) and not n.endswith(("lora_a", "lora_b"))]
        moe = {"qwen3_moe": (48, 128, 3), "35B_A3B": (40, 256, 3), "122B_A10B": (48, 256, 3),
               "26B_A4B": (30, 128, 3), "gpt_oss/20B": (24, 32, 2), "gpt_oss/120B": (36, 128, 2)}
        shape = moe.get(f"{family}/{size}") or moe.get(family) or moe.get(size)  # layers, experts, projections
        if shape is not None:
            # attention (and DeltaNet) adapted; experts frozen (NF4 under QLoRA); routers as they are; Gemma 4's
            # dense MLPs beside the experts frozen too (NF4 under QLoRA)
            experts = [m for n, m in model.named_modules() if ".experts." in n and n.endswith("_proj")]
            layers, n_experts, projections = shape
            assert len(experts) == layers * projections, name
            assert all(type(m) is ExpertLinear and m.n_experts == n_experts for m in experts), name
            assert all(m.nf4 == bool(lora.quantize_base) for m in experts), name
            dense = [m for n, m in model.named_modules()  # the shared expert, or Gemma 4's dense MLP beside
                     if ".mlp." in n and n.endswith("_proj") and ".experts." not in n]
            assert all(type(m) is frozen_type for m in dense), name
            continue
        assert all(isinstance(m, LoRALinear) for m in block_linears), name  # all of them are adapted
        assert all(m.quantize_base == bool(lora.quantize_base) for m in block_linears), name
        n_nf4 = sum(isinstance(m, FrozenNF4Linear) for m in model.modules())
        assert n_nf4 == (len(per_layer) if lora.quantize_base else 0), name  # nothing else left unadapted


def test_mtune_ls_lists_every_config_under_its_recipe(loaded):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "mtune", "ls"], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True).stdout
    listed, recipe = {}, None
    for line in out.splitlines()[1:]:
        parts = line.split()
        if not line.startswith(" "):
            recipe, parts = parts[0], parts[1:]
        for config in parts:
            if config != "-":
                listed[config] = recipe
    assert listed == {name: cfg.recipe for name, (cfg, _) in loaded.items()}
