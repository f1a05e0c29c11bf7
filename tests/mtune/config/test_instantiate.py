"""instantiate(): nested components, positional args, kwargs from code, and its errors."""

import fractions

import pytest
import torch
from omegaconf import OmegaConf

from mtune.config import ComponentError, ConfigError, instantiate


def test_optimizer_with_positional_params_matches_direct_construction():
    model = torch.nn.Linear(3, 2)
    cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "lr": 0.01, "betas": [0.8, 0.9]}})
    opt = instantiate(cfg.optimizer, model.parameters())
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["lr"] == 0.01 and tuple(opt.defaults["betas"]) == (0.8, 0.9)
    assert opt.param_groups[0]["params"][0] is model.weight


def test_kwargs_in_code_win_and_nested_components_are_built():
    cfg = OmegaConf.create(
        {
            "out": "/x",
            "node": {
                "_component_": "collections.namedtuple",
                "typename": "Pair",
                "field_names": ["a", "b"],
                "defaults": [{"_component_": "fractions.Fraction", "numerator": 1, "denominator": 3}, "${out}"],
            },
        }
    )
    pair_type = instantiate(cfg.node, typename="Other")
    assert pair_type.__name__ == "Other"
    made = pair_type()
    assert made.a == fractions.Fraction(1, 3) and made.b == "/x"


def test_none_gives_none_and_plain_dict_works():
    assert instantiate(None) is None
    assert instantiate({"_component_": "fractions.Fraction", "numerator": 2, "denominator": 6}) == fractions.Fraction(1, 3)


def test_unknown_component_names_key_and_closest_name():
    cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamWW", "lr": 1.0}})
    with pytest.raises(ConfigError) as err:
        instantiate(cfg.optimizer, [])
    assert str(err.value) == (
        "optimizer._component_: cannot import 'torch.optim.AdamWW': 'torch.optim' has no attribute 'AdamWW'"
        " (did you mean 'torch.optim.AdamW'?)"
    )
    cfg = OmegaConf.create({"loss": {"_component_": "torhc.nn.CrossEntropyLoss"}})
    with pytest.raises(ConfigError, match=r"^loss._component_: .*no module named 'torhc' \(did you mean 'torch'\?\)"):
        instantiate(cfg.loss)


def test_unknown_keyword_names_key_and_closest_parameter():
    cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.SGD", "lr": 0.1, "momentun": 0.9}})
    with pytest.raises(ConfigError) as err:
        instantiate(cfg.optimizer, torch.nn.Linear(2, 2).parameters())
    assert str(err.value) == "optimizer.momentun: SGD does not accept 'momentun' (did you mean 'momentum'?)"


def test_missing_required_argument_names_it():
    cfg = OmegaConf.create({"frac": {"_component_": "string.Template"}})
    with pytest.raises(ConfigError, match=r"^frac: Template is missing the required argument 'template'") as err:
        instantiate(cfg.frac)
    assert "frac.template=" in err.value.hint


def test_var_kwargs_target_accepts_any_keyword():
    cfg = OmegaConf.create({"d": {"_component_": "argparse.Namespace", "anything": 1, "else_": [1]}})
    ns = instantiate(cfg.d)
    assert ns.anything == 1 and ns.else_ == [1]


def _takes_flags(strict: bool = False, maybe: "bool | None" = None, loose=False, anything=None):
    return strict, maybe, loose, anything


def test_boolean_arguments_take_true_or_false_only_and_unannotated_ones_are_named():
    from mtune.config.instantiate import value_problems
    from mtune.config.validate import validate_config

    target = f"{__name__}._takes_flags"
    ok = OmegaConf.create({"c": {"_component_": target, "strict": True, "maybe": None, "loose": False, "anything": 1}})
    assert instantiate(ok.c) == (True, None, False, 1)
    report = validate_config(ok)
    assert report.errors == [] and report.unchecked == ["c.anything"]  # no annotation, no boolean default
    for name, value in [("strict", "maybe"), ("strict", 1), ("strict", None), ("maybe", "yes"), ("loose", "no")]:
        bad = OmegaConf.create({"c": {"_component_": target, name: value}})
        shown = "null" if value is None else f"{type(value).__name__} {value!r}"
        message = f"c.{name}: _takes_flags takes true or false, got {shown}"
        assert validate_config(bad).errors == [message]
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            instantiate(bad.c)
    assert value_problems(_takes_flags, {"maybe": None, "strict": False}, "c") == ([], [])


def _takes_numbers(beta: float = 0.1, steps: "int | None" = None, scale: float | None = None, n: int = 1):
    return beta, steps, scale, n


def test_number_arguments_take_numbers_before_the_run_builds_them():
    """A ``float``/``int`` parameter given a string (``loss.beta=abc``) is named by ``mtune validate``; before, the
    run failed only when it built the component, after reading its data, with the target's own TypeError."""
    from mtune.config.validate import validate_config

    target = f"{__name__}._takes_numbers"
    ok = OmegaConf.create({"c": {"_component_": target, "beta": 1, "steps": None, "scale": 0.5, "n": 3}})
    assert instantiate(ok.c) == (1, None, 0.5, 3) and validate_config(ok).errors == []
    for name, value, wanted in [("beta", "abc", "a number"), ("beta", True, "a number"), ("beta", None, "a number"),
                                ("steps", 2.5, "an integer"), ("scale", "1e-4", "a number"), ("n", "3", "an integer")]:
        bad = OmegaConf.create({"c": {"_component_": target, name: value}})
        shown = "null" if value is None else f"{type(value).__name__} {value!r}"
        message = f"c.{name}: _takes_numbers takes {wanted}, got {shown}"
        assert validate_config(bad).errors == [message]
        with pytest.raises(ConfigError) as err:
            instantiate(bad.c)
        assert str(err.value) == message


def test_a_component_that_raises_inside_its_call_is_one_line_naming_key_target_and_error():
    cfg = OmegaConf.create({"metric_logger": {"_component_": "os.system", "command": "${oops}"}, "oops": [1, 2]})
    with pytest.raises(ComponentError) as info:
        instantiate(cfg.metric_logger)
    assert str(info.value) == ("metric_logger: os.system raised TypeError: expected str, bytes or os.PathLike object, "
                               "not list")
    assert isinstance(info.value.__cause__, TypeError) and "MTUNE_DEBUG=1" in info.value.hint
    # mtune's own errors stay as they are
    with pytest.raises(ConfigError, match="num_warmup_steps must be >= 0") as info:
        instantiate({"_component_": "mtune.training.lr_schedulers.get_constant_schedule_with_warmup",
                     "num_warmup_steps": -1}, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    assert not isinstance(info.value, ComponentError)


def test_an_optimizer_or_metric_logger_component_that_raises_is_one_line_too(tmp_path):
    from mtune.training.observe.metric_logging import build_metric_logger
    from mtune.training.optimizers import build_optimizer

    with pytest.raises(ComponentError, match=r"^optimizer: os\.system raised TypeError: "):
        build_optimizer({"_component_": "os.system"}, torch.nn.Linear(2, 2))  # given the model's parameters
    with pytest.raises(ComponentError, match=r"^metric_logger: fractions\.Fraction raised TypeError: "):
        build_metric_logger({"_component_": "fractions.Fraction"}, output_dir=tmp_path)  # given output_dir=


def _takes_raw(items, scale: float = None):
    return items, scale


_takes_raw.__instantiate_raw__ = ("items",)


def test_raw_keys_come_resolved_but_unbuilt():
    """A key in __instantiate_raw__ is plain config with its interpolations resolved, nested components not built."""
    cfg = OmegaConf.create({"out": "/x", "c": {"_component_": f"{__name__}._takes_raw", "items": [
        "${out}/a", {"_component_": "fractions.Fraction", "numerator": "${n}"}]}, "n": 3})
    assert instantiate(cfg.c) == (["/x/a", {"_component_": "fractions.Fraction", "numerator": 3}], None)


def test_null_is_accepted_for_a_number_parameter_whose_default_is_none():
    """`scale: float = None` takes null (its default), though its annotation says float."""
    cfg = OmegaConf.create({"c": {"_component_": f"{__name__}._takes_raw", "items": [], "scale": None}})
    assert instantiate(cfg.c) == ([], None)


def _runs_out_of_memory():
    raise torch.OutOfMemoryError("CUDA out of memory")


def test_running_out_of_memory_inside_a_component_passes_through():
    """OOM is not a config problem: it reaches the run's out-of-memory advice as itself, not as a ComponentError."""
    with pytest.raises(torch.OutOfMemoryError) as info:
        instantiate({"_component_": f"{__name__}._runs_out_of_memory"})
    assert not isinstance(info.value, ComponentError)
