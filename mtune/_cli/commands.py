"""``mtune ls``, ``mtune cp`` and ``mtune validate``."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from mtune._cli.catalog import builtin_configs, builtin_recipes, configs_by_recipe, find_config, find_recipe, recipes_dir
from mtune._cli.errors import CliError
from mtune.config.errors import did_you_mean


def ls_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mtune ls", description="List the built-in recipes and their configs.")
    parser.parse_args(argv)
    recipes, table = builtin_recipes(), configs_by_recipe()
    names = list(recipes) + sorted(r for r in table if r not in recipes)
    labels = {n: n if n in recipes else f"{n} (no such recipe)" for n in names}
    width = max([len("RECIPE")] + [len(label) for label in labels.values()]) + 2
    if not names:
        print(f"no built-in recipes in {recipes_dir()}")
        return 0
    print(f"{'RECIPE':<{width}}CONFIGS")
    for name in names:
        configs = table.get(name, [])
        print(f"{labels[name]:<{width}}{configs[0] if configs else '-'}")
        for config in configs[1:]:
            print(f"{'':<{width}}{config}")
    return 0


def cp_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mtune cp", description="Copy a built-in recipe or config to DEST, to edit it."
    )
    parser.add_argument("name", metavar="NAME", help="a recipe (e.g. lora_single_device) or config name from `mtune ls`")
    parser.add_argument("dest", metavar="DEST", help="file to write, or an existing directory to copy into")
    parser.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    args = parser.parse_args(argv)
    recipes, configs = builtin_recipes(), builtin_configs()
    name = args.name[:-5] if args.name.endswith(".yaml") else args.name
    source = recipes.get(args.name[:-3] if args.name.endswith(".py") else args.name) or configs.get(name)
    if source is None:
        suggestion = did_you_mean(name, [*recipes, *configs])
        raise CliError(f"no built-in recipe or config named '{args.name}'{suggestion}", "`mtune ls` lists them")
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.force:
        raise CliError(f"{dest} already exists", "pass --force to overwrite it")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
    except OSError as err:  # a file where a directory should be, a directory at DEST, no permission
        raise CliError(f"cannot write {dest}: {err.strerror or err}", "choose another DEST") from None
    print(f"copied {source} to {dest}")
    return 0


def validate_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mtune validate",
        description="Check a config without running it: YAML, overrides, every _component_ and its keywords, "
        "the recipe-level keys of the recipe named by its `recipe:` key, and the recipe's rules. "
        "Paths that do not exist are listed as warnings. Exit 0 when valid, 1 otherwise.",
    )
    parser.add_argument("config", metavar="CONFIG", help="a built-in config name or a YAML path")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, as for `mtune run`")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unexpected option {unknown[0]}: write overrides as key=value")
    from mtune.config import load_config, validate_config

    config_path = find_config(args.config)
    cfg = load_config(config_path, args.overrides)
    errors, schema = [], None
    recipe = cfg.get("recipe")
    if recipe is None:
        print("warning: the config has no `recipe:` key, so its recipe-level keys are not checked", file=sys.stderr)
    else:
        try:
            from mtune._cli.catalog import load_recipe_module

            schema = load_recipe_module(find_recipe(str(recipe))).SCHEMA
        except CliError as err:
            errors.append(f"recipe: {err}")
        else:
            cfg = load_config(config_path, args.overrides, schema.text_keys)  # text keys keep their overrides as written
    report = validate_config(cfg, schema)
    errors += report.errors
    for warning in report.warnings:
        print(f"warning: {warning}")
    for key in report.unchecked:
        print(f"note: {key}: not type-checked (its parameter has no annotation)")
    for note in report.notes:
        print(f"note: {note}")
    if report.foreign:  # a config calls what it names: say which code from outside the usual packages it would run
        print("components from outside mtune, torch, torchao and bitsandbytes (the run calls them: trust their "
              "source):")
        print("".join(f"  {component}\n" for component in report.foreign), end="")
    for problem in errors:
        print(f"error: {problem}")
    if errors:
        print(f"{config_path}: {len(errors)} problem{'s' if len(errors) > 1 else ''}")
        return 1
    print(f"{config_path}: valid" + (f" for recipe {recipe}" if recipe else ""))
    return 0
