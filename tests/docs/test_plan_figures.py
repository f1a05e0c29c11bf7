"""The shipped configs' header memory blocks and docs/configs.md's memory table are generated from
benchmarks/results/plan_configs.json by scripts/render_plan_figures.py; these tests render them again in memory and
require the committed files to be identical, so a figure edited by hand (or a results file re-planned without
rendering) fails. Checked against a mutation: 18.1 -> 18.2 GiB hand-edited in the header of
llama3_1/8B_full_single_device_low_memory and in its docs/configs.md row, each failed its test."""

import pytest

from tests._helpers.scripts import REPO, load_script

render = load_script("render_plan_figures")
RESULTS = render.load_results()


def test_every_shipped_training_config_has_a_plan():
    """Every shipped training config has a plan_configs.json record, so its header is rendered from it and checked
    by the next test (the DPO configs' headers name their reference choice; the other choices' plans are in
    benchmarks/results/dpo_references.json, quoted in docs/memory.md)."""
    assert sorted(set(render.shipped_training_configs()) - set(RESULTS)) == []


@pytest.mark.parametrize("config", sorted(RESULTS))
def test_the_config_header_is_rendered_from_plan_configs(config):
    path = render.CONFIGS / f"{config}.yaml"
    assert path.exists(), f"{config}: a plan in plan_configs.json for a config that is not shipped"
    expected, actual = render.rendered_header(config, RESULTS[config]), path.read_text()
    assert actual == expected, (f"{path.relative_to(REPO)}: header differs from plan_configs.json's figures; run "
                                "python scripts/render_plan_figures.py")


def test_the_configs_doc_table_is_rendered_from_plan_configs():
    path = REPO / "docs" / "configs.md"
    assert path.read_text() == render.rendered_table(RESULTS), (
        "docs/configs.md: memory table differs from plan_configs.json's figures; run python "
        "scripts/render_plan_figures.py")
