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


# ---------------------------------------------------------------- every training option: a parameter, or why not

# TrainConfig fields that `logit-distill train` sets and no pipeline parameter feeds to the training, and why.
NOT_PIPELINE_PARAMETERS = {
    "output": "the pipeline names the training folder, <output_root>/students/<train_key>/ (output_root)",
    "store": "the store the pipeline dumped and verified (the from-store pipelines' store parameter), as an "
             "artifact",
    **{name: "online training only (a teacher run in the loop): the pipelines train from the store; the "
             "parameters of these names are the dump's" for name in
       ("teacher", "data", "top_k", "seq_len", "samples", "proposal_temperature", "packing", "data_seed")},
    "num_examples": "online training only: a store holds what it holds",
    "text_field": "the store records the field its data was read with, and eval_data is read with it (the "
                  "text_field parameter is the dump's)",
    "chat": "the store records the conversation options its data was read with, and eval_data is read with "
            "them (the conversation parameters are the dump's)",
    **{name: "the pipeline trains with TrainConfig's default; not a parameter yet (one would have to enter "
             "the train key only when not the default, so that the folders of earlier runs still resume)"
       for name in ("end_lr_fraction", "weight_decay", "max_grad_norm", "param_sharding")},
    "keep_checkpoints": "the training keeps TrainConfig's default number of checkpoints",
    "max_eval_examples": "an input of the training component (0: every held-out example) no parameter feeds",
    "log_every": "an input of the training component (its default, 10 optimizer steps) no parameter feeds",
    "progress": "a task has no terminal: the components give progress=False",
    "report": "the training component always has the run write report.md and loss.png (its HTML report "
              "embeds loss.png)",
    "force_takeover": "the training task takes its folder's lease without force_takeover; not a parameter yet",
    "lease_timeout_s": "the training task holds its folder's lease at TrainConfig's default timeout; not a "
                       "parameter yet",
}


def _cli_train_fields() -> set:
    """The TrainConfig fields `logit-distill train` sets (config_from_args: ``field=args.<flag>``)."""
    import inspect
    import re

    from logit_distill.cli import train as train_cli

    return set(re.findall(r"(\w+)=(?:args\.|chat_options\(args\))", inspect.getsource(train_cli.config_from_args)))


def test_every_training_option_of_the_command_line_is_a_pipeline_parameter_or_said_why_not():
    """So that a training option added to the CLI cannot silently be missing from the pipelines: each is fed to
    the training component by a parameter of the table, or listed above with the reason."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cli = _cli_train_fields()
    assert cli == fields, sorted(fields ^ cli)  # the command line sets every field (the regex sees them all)
    fed = {param.to[params.TRAIN] or param.name: param for param in params.PARAMS if params.TRAIN in param.to}
    fed = {TRAIN_FIELDS.get(name, name) for name in fed} & fields
    missing = sorted(cli - fed - set(NOT_PIPELINE_PARAMETERS))
    assert not missing, f"TrainConfig fields the CLI exposes that are no pipeline parameter: {missing}; add a " \
                        "row to pipelines/params.py (and the component inputs), or say why not here"
    stale = sorted(set(NOT_PIPELINE_PARAMETERS) & fed)
    assert not stale, f"now pipeline parameters: drop them from NOT_PIPELINE_PARAMETERS: {stale}"
    assert set(NOT_PIPELINE_PARAMETERS) <= fields, sorted(set(NOT_PIPELINE_PARAMETERS) - fields)
    # the training plan takes every parameter of the training that is in the train key or checked before it
    plan = {param.name for param in params.PARAMS if params.TRAIN_PLAN in param.to}
    train = {param.name for param in params.PARAMS if params.TRAIN in param.to}
    assert train - plan == {"checkpoint_every"}, train - plan


@pytest.mark.parametrize("field,value", [("jsd_beta", 0.25), ("skew", 0.3)])
def test_a_loss_setting_is_in_the_train_key_only_with_a_loss_that_uses_it(field, value):
    """As in the training's identity (train_config.json): jsd_beta only with a *_jsd loss, skew only with a
    *_skew_* one, allow_biased_temperature only when set; the default settings keep their earlier key."""
    from logit_distill.train.key import train_key, training_settings

    base = dict(student="s", num_steps=10, batch_size=4, grad_accum=1, learning_rate=3e-4, warmup_steps=-1,
                seed=0, alpha=1.0, alpha_end=-1.0, alpha_schedule="constant", temperature=1.0)
    uses = "sampled_jsd" if field == "jsd_beta" else "topk_tail_skew_kl"

    def key(loss, **extra):
        return train_key("", training_settings(loss=loss, **base, **extra), fingerprint="f" * 16)

    for loss in ("", "hybrid_kl", "topk_tail_kl", "sampled_kl"):
        assert key(loss, **{field: value}) == key(loss)
    assert key(uses, **{field: value}) != key(uses)
    assert training_settings(loss=uses, **base, **{field: value})[field] == value
    assert key("sampled_kl", allow_biased_temperature=True) != key("sampled_kl")
    assert "allow_biased_temperature" not in training_settings(loss="sampled_kl", **base)
    assert set(training_settings(loss="", **base)) == {*base, "loss"}  # the key of earlier folders


def test_the_pipelines_refuse_what_the_training_refuses_about_evaluation():
    required = {"teacher": "t", "data": "d", "student": "s", "output_root": "o", "dump_num_steps": 1}
    assert params.check({**required, "eval_data": "e", "eval_teacher": "preset:x"}, "local") == []
    assert params.check({**required, "eval_store": "h"}, "local") == []
    both = params.check({**required, "eval_data": "e", "eval_store": "h"}, "local")
    assert len(both) == 1 and both[0].startswith("eval_store holds its own held-out examples"), both
    alone = params.check({**required, "eval_teacher": "preset:x"}, "local")
    assert alone == ["eval_teacher runs the teacher on eval_data; give eval_data too"]
    for name in ("jsd_beta", "skew"):
        for bad in (0.0, 1.0):
            assert params.check({**required, name: bad}, "local") == [
                f"{name}={bad!r} is not in the open interval (0, 1)"]
        assert params.check({**required, name: 0.5}, "local") == []
