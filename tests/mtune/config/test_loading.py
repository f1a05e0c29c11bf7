"""Loading YAML, interpolation, and every command-line override form."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mtune.config import ConfigError, apply_overrides, load_config


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "output_dir: /tmp/run\n"
        "log_dir: ${output_dir}/logs\n"
        "batch_size: 2\n"
        "optimizer:\n  _component_: torch.optim.AdamW\n  lr: 0.001\n  betas: [0.9, 0.95]\n"
        "dataset:\n  data_files: a.json\n  split: train\n"
    )
    return path


def test_load_and_interpolation_is_lazy(config_file):
    cfg = load_config(config_file)
    assert cfg.log_dir == "/tmp/run/logs"
    cfg.output_dir = "/elsewhere"
    assert cfg.log_dir == "/elsewhere/logs"
    assert list(cfg.optimizer.betas) == [0.9, 0.95]


def test_overrides_every_form(config_file):
    cfg = load_config(
        config_file,
        [
            "batch_size=8",
            "optimizer.lr=3e-4",
            "optimizer.eps=[1e-8, 2E+3]",
            "optimizer.weight_decay=0.1",  # new key inside a node
            "a.b.c=true",  # new nested path
            "dataset.data_files=[x.json,y.json]",
            "dataset.extra={k: 1, j: [1, 2]}",
            "~dataset.split",
            "output_dir=/tmp/other",
            "seed=null",
            "name=some text",
        ],
    )
    assert cfg.batch_size == 8 and isinstance(cfg.batch_size, int)
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.weight_decay == 0.1
    assert list(cfg.optimizer.eps) == [1e-8, 2000.0]
    assert cfg.a.b.c is True
    assert list(cfg.dataset.data_files) == ["x.json", "y.json"]
    assert OmegaConf.to_container(cfg.dataset.extra) == {"k": 1, "j": [1, 2]}
    assert "split" not in cfg.dataset
    assert cfg.log_dir == "/tmp/other/logs"  # interpolation follows the override
    assert cfg.seed is None and cfg.name == "some text"


def test_override_component_keeps_other_keys(config_file):
    cfg = load_config(config_file, ["optimizer=torch.optim.SGD"])
    assert cfg.optimizer._component_ == "torch.optim.SGD"
    assert cfg.optimizer.lr == 0.001


def test_override_replaces_plain_value_with_string(config_file):
    cfg = load_config(config_file, ["dataset=tatsu-lab/alpaca"])  # no _component_: the node is replaced
    assert cfg.dataset == "tatsu-lab/alpaca"


def test_delete_top_level_and_list_item(config_file):
    cfg = load_config(config_file, ["~log_dir", "~optimizer.betas.0"])
    assert "log_dir" not in cfg and list(cfg.optimizer.betas) == [0.95]


def test_delete_missing_key_names_it_and_suggests(config_file):
    with pytest.raises(ConfigError, match=r"~optimizer.lrr.*did you mean 'lr'"):
        load_config(config_file, ["~optimizer.lrr"])


@pytest.mark.parametrize("bad", ["batch_size", "--lr=3", "=3"])
def test_malformed_override(config_file, bad):
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides(load_config(config_file), [bad])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of keys"):
        load_config(listing)


def test_mtune_asset_resolver_points_inside_the_package(tmp_path):
    import mtune

    path = tmp_path / "c.yaml"
    path.write_text("model_dir: ${mtune_asset:tiny/model}\n")
    cfg = load_config(path)
    assert cfg.model_dir == str(Path(mtune.__file__).resolve().parent / "assets" / "tiny" / "model")


def test_overrides_apply_in_order_so_the_last_wins(config_file):
    """`batch_size=4 batch_size=8` is 8, and a key deleted then set again is set."""
    cfg = load_config(config_file, ["batch_size=4", "batch_size=8", "~log_dir", "log_dir=/x"])
    assert cfg.batch_size == 8 and cfg.log_dir == "/x"


def test_a_mapping_override_replaces_the_node_rather_than_merging(config_file):
    """`dataset={...}` is the whole new node: the old node's keys (split) do not survive it."""
    cfg = load_config(config_file, ["dataset={data_files: b.json}"])
    assert OmegaConf.to_container(cfg.dataset) == {"data_files": "b.json"}


def test_signed_exponent_floats_are_numbers(config_file):
    """PyYAML reads 1e-4 as text; overrides read it, signed or not, as the float it is."""
    cfg = load_config(config_file, ["optimizer.lr=-1e-4", "optimizer.weight_decay=+2E-3", "optimizer.eps=1e-8"])
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.eps) == (-0.0001, 0.002, 1e-08)


def test_deleting_past_the_end_of_a_list_is_one_line(config_file):
    """`~optimizer.betas.2` of a two-item list names the key (not an IndexError)."""
    with pytest.raises(ConfigError, match=r"cannot delete '~optimizer.betas.2': the config has no key"):
        load_config(config_file, ["~optimizer.betas.2"])


def test_text_keys_keep_their_value_but_empty_null_and_tilde_are_none(config_file):
    """A key declared as text takes `123` as written; only ``, `null` and `~` mean None there."""
    cfg = load_config(config_file, ["p=123", "q=", "r=null", "s=~", "t=1e-4"], text_keys={"p", "q", "r", "s", "t"})
    assert (cfg.p, cfg.q, cfg.r, cfg.s, cfg.t) == ("123", None, None, None, "1e-4")
