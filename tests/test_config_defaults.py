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
