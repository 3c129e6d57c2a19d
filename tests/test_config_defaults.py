"""The pipeline's parameter table and the stages' configs agree on every default.

A pipeline parameter that feeds the dump or the training component stands for a field of
``DumpConfig`` / ``TrainConfig``; its default in the table (pipelines/params.py) must be the
config's, read through the table's conventions for "not set" (0, -1 or "" where the config has
None, "" where it has no tail temperatures).
"""

from __future__ import annotations

import dataclasses

import pytest

from logit_distill.dump import DumpConfig
from logit_distill.train import TrainConfig
from pipelines import params

# component input -> config field, where the names differ
DUMP_FIELDS = {"data_seed": "seed"}
TRAIN_FIELDS: dict[str, str] = {}
# inputs whose table default applies only with another setting (samples: with selection sampled)
CONDITIONAL = {"samples"}
UNSET = (0, -1, "")


def _config_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def _pairs(component: str, cls, renames: dict):
    defaults = _config_defaults(cls)
    for param in params.PARAMS:
        if component not in param.to:
            continue
        field = renames.get(param.to[component] or param.name, param.to[component] or param.name)
        if field in defaults and field not in CONDITIONAL and param.default_in("local") is not params.REQUIRED:
            yield param, field, defaults[field]


def _same(table, config) -> bool:
    if config is None:
        return table in UNSET
    if config == ():
        return table == ""
    return table == config


@pytest.mark.parametrize("component,cls,renames", [(params.DUMP, DumpConfig, DUMP_FIELDS),
                                                   (params.TRAIN, TrainConfig, TRAIN_FIELDS)],
                         ids=["dump", "train"])
def test_pipeline_defaults_are_the_configs(component, cls, renames):
    pairs = list(_pairs(component, cls, renames))
    assert len(pairs) >= 8, pairs  # the table feeds the component many of its config's fields
    wrong = [(p.name, p.default_in("local"), field, value) for p, field, value in pairs
             if not _same(p.default_in("local"), value)]
    assert not wrong, wrong


def test_the_conversation_parameters_default_to_the_default_chat_options():
    from logit_distill.data import ChatOptions
    from logit_distill.data.conversations import FLAT_FIELDS

    chat = {p.name: p.default_in("local") for p in params.PARAMS if p.name in FLAT_FIELDS}
    assert set(chat) == set(FLAT_FIELDS)
    assert all(params.DUMP in params.PARAMS[[q.name for q in params.PARAMS].index(n)].to for n in chat)
    assert ChatOptions.from_flat(**chat) == ChatOptions()
    assert DumpConfig.from_flat(teacher="t", data="d", output="o", num_steps=1, **chat).chat == ChatOptions()


# ---------------------------------------------------------------- the selection's defaults, resolved once


def _resolved(config) -> tuple:
    return config.selection, config.top_k, config.samples


def test_each_selection_resolves_its_own_top_k_and_samples():
    base = dict(teacher="t", data="d", output="o")
    assert _resolved(DumpConfig(**base).check()) == ("hybrid", 4, 16)  # the default store
    assert _resolved(DumpConfig(top_k=8, **base).check()) == ("hybrid", 8, 16)
    assert _resolved(DumpConfig(samples=32, **base).check()) == ("hybrid", 4, 32)
    assert _resolved(DumpConfig(selection="topk", **base).check()) == ("topk", 64, None)
    assert _resolved(DumpConfig(selection="sampled", samples=32, **base).check()) == ("sampled", 32, 32)
    # given explicitly, the same values are the same config (hence the same store)
    assert DumpConfig(**base) == DumpConfig(selection="hybrid", top_k=4, samples=16, **base)
    assert DumpConfig(selection="topk", **base) == DumpConfig(selection="topk", top_k=64, **base)


@pytest.mark.parametrize("given,message", [
    (dict(selection="sampled"), "--selection sampled needs --samples N"),
    (dict(selection="topk", samples=16), "--samples applies to --selection sampled or hybrid"),
    (dict(top_k=300), "--top-k must be <= 255"),
    (dict(selection="hybrid", samples=0), "needs --samples N with 1 <= N <= 65535, got 0"),
])
def test_explicit_values_are_refused_as_before(given, message):
    from logit_distill.errors import InputError

    with pytest.raises(InputError, match=message):
        DumpConfig(teacher="t", data="d", output="o", **given).check()


def _cli_config(*flags):
    import argparse

    from logit_distill.cli import dump as dump_cli

    p = argparse.ArgumentParser()
    dump_cli.add_arguments(p)
    return dump_cli.config_from_args(p.parse_args(["--teacher", "t", "--data", "d", "--output", "o", *flags]))


@pytest.mark.parametrize("flags,pipeline,want", [
    ((), {}, ("hybrid", 4, 16)),
    (("--top-k", "8"), {"top_k": 8}, ("hybrid", 8, 16)),
    (("--samples", "32"), {"samples": 32}, ("hybrid", 4, 32)),
    (("--selection", "topk"), {"selection": "topk"}, ("topk", 64, None)),
    (("--selection", "topk", "--top-k", "16"), {"selection": "topk", "top_k": 16}, ("topk", 16, None)),
    (("--selection", "sampled", "--samples", "32"), {"selection": "sampled", "samples": 32}, ("sampled", 32, 32)),
])
def test_the_pipelines_zeros_resolve_as_the_command_lines_omitted_flags(flags, pipeline, want):
    """The pipeline's table defaults (top_k 0, samples 0: unset) through the components' helper give the
    config the command line gives without those flags."""
    import inspect

    from components.plan_dump import plan_dump

    inputs = {name: arg.default for name, arg in inspect.signature(plan_dump).parameters.items()}
    inputs.update(teacher="t", data="d", output_root="o", num_steps=None, **pipeline)
    from_pipeline = DumpConfig.from_component(inputs, output="o")
    from_cli = _cli_config(*flags)
    assert _resolved(from_pipeline.check()) == _resolved(from_cli.check()) == want
    assert from_pipeline == from_cli


def test_a_sampled_dump_without_samples_is_one_line(capsys, tmp_path):
    from logit_distill.cli import main as cli_main

    code = cli_main(["dump", "--teacher", "preset:tiny-qwen3", "--data", str(tmp_path / "d.jsonl"), "--output",
                     str(tmp_path / "s"), "--selection", "sampled", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("logit-distill dump: error: --selection sampled needs --samples N"), err
    assert not (tmp_path / "s").exists()
    problems = params.check({"teacher": "t", "data": "d", "student": "s", "output_root": "o", "dump_num_steps": 1,
                             "selection": "sampled"}, "local")
    assert problems == ["selection sampled needs samples=N (draws per position, 1 to 65535): a sampled store has "
                        "no default N"]
