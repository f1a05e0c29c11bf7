"""The key declarations: each YAML name declared once, and the memory keys carried under their own names."""

from omegaconf import OmegaConf

from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune.config import Key, KeyGroup, Node
from mtune.config import keys as declared
from mtune.training.memory import registry
from mtune.training.memory.registry import MEMORY_KEYS, MemoryConfig
from mtune.training.memory.techniques.weight_offloading import WeightOffloading
from mtune.training.memory.techniques.weight_offloading import WEIGHT_OFFLOADING_NODE


def _groups() -> list[KeyGroup]:
    """Every group declared in mtune.config.keys and the registry, and those the recipes compose, with the groups
    inside their nodes."""
    groups = [v for module in (declared, registry) for v in vars(module).values() if isinstance(v, KeyGroup)]
    generate = load_recipe_module(find_recipe("generate")).SCHEMA.groups
    groups += [g for g in generate if all(g is not known for known in groups)]
    inner = [d.keys for g in groups for d in g.keys if isinstance(d, Node) and d.keys is not None]
    return groups + inner


def test_each_memory_key_is_declared_once():
    declarations = [(group.name, decl) for group in _groups() for decl in group.keys]
    for key in MEMORY_KEYS.keys:
        assert [g for g, decl in declarations if decl.name == key.name and decl is not key] == [], key.name
    # weight_offloading is also read by generate: the same declaration object, not a copy
    node = next(key for key in MEMORY_KEYS.keys if key.name == "weight_offloading")
    assert node.keys is WEIGHT_OFFLOADING_NODE.keys
    assert [g for g, decl in declarations if decl is node] == ["memory", "offloading"]


def test_keys_shared_by_recipes_are_one_declaration():
    # recipe, device and dtype mean the same for training and generation: one Key object, not copies
    for name in ("recipe", "device"):
        assert len({id(decl) for _, decl in ((g, d) for g in _groups() for d in g.keys) if decl.name == name}) == 1
    dtype = {id(d) for g in _groups() for d in g.keys if d.name == "dtype" and d.default == "bf16"}
    assert dtype == {id(declared.DTYPE_KEY)}


def test_memory_config_carries_each_memory_key_under_its_yaml_name():
    names = [k.name for k in MEMORY_KEYS.keys]
    assert names == [k.name for t in registry.TECHNIQUES for k in t.Settings.keys()
                     if t is not registry.LORA and k.name != "fsdp_cpu_offload"]
    assert all(isinstance(k, Key) for k in MEMORY_KEYS.keys if k.name != "weight_offloading")
    defaults = MemoryConfig()
    as_declared = {"weight_storage_skip_patterns": list}  # MemoryConfig holds the list as a tuple (frozen)
    assert {n: as_declared.get(n, lambda v: v)(getattr(defaults, n)) for n in names} == {
        k.name: k.default for k in MEMORY_KEYS.keys}
    # from_config reads every key by its own name: change each one and see it arrive
    changed = {"optimizer_offload": "cpu", "weight_offloading": {"type": "leaf_level", "blocks_per_group": 3},
               "weight_storage_dtype": "float8_e5m2", "weight_storage_skip_patterns": ["model.layers.0.*"],
               "activation_checkpointing_policy": "selective_op", "attention_kernel": "dense_mask",
               "activation_offloading_blocks": 5}
    flipped = {k.name: changed[k.name] if k.name in changed else not k.default if isinstance(k.default, bool)
               else k.default + 2 for k in MEMORY_KEYS.keys}
    memory = MemoryConfig.from_config(OmegaConf.create({"output_dir": "x", **flipped}))
    expected = dict(flipped, weight_offloading=WeightOffloading(type="leaf_level", blocks_per_group=3))
    assert {n: as_declared.get(n, lambda v: v)(getattr(memory, n)) for n in names} == expected
    assert memory.weight_offloading.use_streams is True  # a left-out inner key takes its declared default

def test_memory_config_takes_the_declared_default_of_a_left_out_key():
    memory = MemoryConfig.from_config(OmegaConf.create({"enable_activation_checkpointing": True}))
    assert memory.enable_activation_checkpointing is True
    assert {k.name: getattr(memory, k.name) for k in MEMORY_KEYS.keys if k.name != "enable_activation_checkpointing"} \
        == {k.name: getattr(MemoryConfig(), k.name) for k in MEMORY_KEYS.keys if k.name != "enable_activation_checkpointing"}


def test_accumulation_steps_and_samples_per_step():
    from mtune.config.keys import accumulation_steps, samples_per_step

    cases = [  # (config, micro-batches per step, samples per step)
        ({"batch_size": 4, "gradient_accumulation_steps": 8}, 8, 32),
        ({"batch_size": 3}, 1, 3),  # left out: 1
        ({"batch_size": 2, "gradient_accumulation_steps": None}, 1, 2),  # null: 1
        ({"batch_size": "5", "gradient_accumulation_steps": "3"}, 3, 15),  # a string override still counts
        ({"batch_size": 1, "gradient_accumulation_steps": 16}, 16, 16),
    ]
    for node, accumulation, samples in cases:
        for cfg in (node, OmegaConf.create(node)):
            assert (accumulation_steps(cfg), samples_per_step(cfg)) == (accumulation, samples), node
