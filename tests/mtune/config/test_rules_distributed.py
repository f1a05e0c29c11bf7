"""DISTRIBUTED_RULES fire on the combinations measured to fail under FSDP2 and stay quiet on those that work."""

import pytest
from omegaconf import OmegaConf

from mtune.config.rules import DISTRIBUTED_RUN_RULES
from mtune.training.memory.registry import DISTRIBUTED_MEMORY_RULES

DISTRIBUTED_RULES = DISTRIBUTED_RUN_RULES + DISTRIBUTED_MEMORY_RULES


def problems(**cfg):
    conf = OmegaConf.create(cfg)
    return [p for rule in DISTRIBUTED_RULES for p in rule(conf)]


@pytest.mark.parametrize("component", ["torch.optim.AdamW", "torchao.optim.AdamW8bit"])
def test_supported_optimizers_pass(component):
    assert problems(optimizer={"_component_": component}, distributed_backend=None, optimizer_in_bwd=True,
                    lora={"modules": ["q_proj"], "use_dora": True, "quantize_base": True}) == []


@pytest.mark.parametrize("component,fix", [
    ("bitsandbytes.optim.AdamW8bit", "use torchao.optim.AdamW8bit for 8-bit states, or torch.optim.AdamW"),
    ("bitsandbytes.optim.PagedAdamW", "use torchao.optim.AdamW8bit for 8-bit states, or torch.optim.AdamW"),
    ("torchao.optim.AdamW4bit", "use torchao.optim.AdamW8bit or torch.optim.AdamW"),
])
def test_optimizers_that_fail_on_dtensor_are_rejected(component, fix):
    (problem,) = problems(optimizer={"_component_": component})
    assert problem.startswith(f"optimizer._component_={component}") and problem.endswith(fix)


def test_backend_names():
    assert problems(distributed_backend="gloo") == [] and problems(distributed_backend="nccl") == []
    assert problems(distributed_backend="mpi") == [
        "distributed_backend='mpi' is not supported: use null (nccl on GPUs, gloo on CPU), nccl or gloo"]


def test_adapter_start_is_refused_in_distributed_recipes():
    from mtune.training.memory.registry import LORA, MemoryConfig

    def distributed_rules(cfg):
        memory = MemoryConfig("distributed", **cfg)
        return LORA.rules(memory[LORA], memory)

    assert distributed_rules({"lora": {"adapter_dir": None}}) == []
    assert "lora.adapter_dir is not supported by the distributed recipes" in distributed_rules(
        {"lora": {"adapter_dir": "/tmp/a"}})[0]


def test_single_device_offloading_points_to_fsdp_cpu_offload():
    from mtune.training.memory.registry import OPTIMIZER_OFFLOAD, WEIGHT_OFFLOADING, MemoryConfig

    def check_distributed_offload(cfg):
        memory = MemoryConfig("distributed", **cfg)
        return [p for t in (OPTIMIZER_OFFLOAD, WEIGHT_OFFLOADING) for p in t.rules(memory[t], memory)]

    found = check_distributed_offload({"optimizer_offload": "cpu", "weight_offloading": {"type": "leaf_level"}})
    assert len(found) == 2 and all("fsdp_cpu_offload=true" in p for p in found)
    assert "optimizer_offload" in found[0] and "weight_offloading" in found[1]
    assert check_distributed_offload({"optimizer_offload": None, "weight_offloading": None}) == []


def test_fp8_weight_storage_is_refused_in_distributed_recipes():
    found = problems(lora={"modules": ["q_proj"]}, weight_storage_dtype="float8_e4m3fn")
    assert len(found) == 1 and "not supported by the distributed recipes" in found[0]
    assert "weight_storage_dtype=null" in found[0]
    assert problems(lora={"modules": ["q_proj"]}, enable_activation_checkpointing=True,
                    activation_checkpointing_policy="selective_op") == []
