"""What a family declares, held to what it does (issue 36, "a family owns its whole model"):

- every config.json field a family reads is one it declares (``ModelFamily.config_keys``), so each is checked
  before the family reads it: a recording config.json notes every field the family's readers touch, on its tiny
  config and on every preset, nested tables (Qwen3.5's text_config) and copies (``raw | {...}``) included;
- a family's conversions derive its model skeleton from the weight table, or the family says why they ask
  megatron-core (``ModelFamily.skeleton_from_megatron_core``): no family takes the slow path unsaid, and a new
  ``Arch`` field is either modelled by the derivation or named as not.
"""

from __future__ import annotations

import pytest

from megatron_patch.models.description.config_checks import PerLayer, Table
from megatron_patch.models.description.registry import families

WHOLE = "*"  # the recording's mark for a reader that took every field at once (a plain copy: dict(raw), {**raw})


class RecordingConfig(dict):
    """A config.json that notes the path of every field read from it (``log``); its nested objects and its copies
    made with ``|`` or ``.copy()`` note into the same log."""

    def __init__(self, data, log: set, path: str = ""):
        super().__init__(data)
        self.log, self.path = log, path

    def _noted(self, key, value):
        self.log.add(self.path + str(key))
        if isinstance(value, RecordingConfig):  # a nested one put back into a copy (``raw | {"text_config": ...}``)
            return value
        return RecordingConfig(value, self.log, f"{self.path}{key}.") if isinstance(value, dict) else value

    def __getitem__(self, key):
        return self._noted(key, super().__getitem__(key))

    def get(self, key, default=None):
        return self._noted(key, super().get(key, default))

    def __contains__(self, key):
        self.log.add(self.path + str(key))
        return super().__contains__(key)

    def _whole(self):
        self.log.add(self.path + WHOLE)

    def keys(self):
        self._whole()
        return super().keys()

    def items(self):
        self._whole()
        return super().items()

    def values(self):
        self._whole()
        return super().values()

    def __iter__(self):
        self._whole()
        return super().__iter__()

    def copy(self):
        return RecordingConfig(dict(dict.items(self)), self.log, self.path)

    def __or__(self, other):
        return RecordingConfig({**dict(dict.items(self)), **other}, self.log, self.path)


def fields_read(family, raw: dict, log: set | None = None) -> set[str]:
    """The fields the family's readers touch (noted into ``log`` as they are read): its parser, then what reads the
    parsed model's config.json (its TransformerConfig fields, its weight table, its MTP layers)."""
    log = set() if log is None else log
    arch = family.parse_config(RecordingConfig(raw, log))
    family.transformer_config_kwargs(arch)
    family.weight_rules(arch)
    family.hf_mtp_layers(RecordingConfig(raw, log))
    return log


def fields_read_without_each(family, raw: dict) -> set[str]:
    """``fields_read`` on ``raw`` and on ``raw`` less each field it has in turn: a field read only where another is
    missing (an alias: num_local_experts for num_experts) is read there. A config the family then refuses counts
    what was read before the refusal."""
    from megatron_patch.errors import UserError

    log = fields_read(family, raw)
    for name in raw:
        if name in ("model_type", "architectures"):
            continue
        try:
            fields_read(family, {k: v for k, v in raw.items() if k != name}, log)
        except (UserError, ValueError, KeyError, TypeError):
            pass
    return log


def undeclared(declared: dict, read: set[str]) -> list[str]:
    """The fields of ``read`` (dotted paths) that ``declared`` does not name (nor its nested tables)."""
    from megatron_patch.models.description.config_checks import COMMON_KEYS

    out = []
    for path in sorted(read):
        rules = {**COMMON_KEYS, **declared}
        *parents, name = path.split(".")
        rule = None
        for parent in parents:
            rule = rules.get(parent)
            rules = rule.fields if isinstance(rule, Table) else {}
        if name == WHOLE and isinstance(rule, PerLayer):  # keyed by layer numbers: read whole, checked per layer
            continue
        if name not in rules:
            out.append(path)
    return out


@pytest.mark.parametrize("name", list(families()))
def test_a_family_declares_every_config_field_it_reads(name):
    family = families()[name]
    for size, raw in {"tiny": family.tiny_config, **family.presets}.items():
        read = fields_read_without_each(family, raw)
        per_layer = {k for k, rule in family.config_keys.items() if isinstance(rule, PerLayer)}
        whole = sorted(p for p in read if p.endswith(WHOLE) and p[:-len(WHOLE) - 1] not in per_layer)
        assert not whole, f"{name} {size}: a reader copies config.json whole ({whole}); write raw | {{...}} instead, " \
                          "so the fields it reads stay known"
        missing = undeclared(family.config_keys, read)
        assert not missing, f"{name} {size} reads {missing} without declaring them: add each to the family's " \
                            "config_keys with its check (models/config_checks.py)"


def test_an_undeclared_field_is_found_and_a_declared_one_checked():
    """The recording sees a field read through a copy and inside a nested table; and a declared field's bad
    value is refused in one line naming it, nested ones by their path."""
    import dataclasses

    from megatron_patch.errors import UserError
    from megatron_patch.models.description.registry import parse_arch

    llama = families()["llama3_1"]

    def reads_more(raw):
        raw = raw | {"extra": 1}
        raw.get("rope_scaling", {}).get("new_knob")
        return llama.parse_config(raw | {"also": raw.get("sneaky_field")})

    stand_in = dataclasses.replace(llama, parse_config=reads_more)
    assert undeclared(llama.config_keys, fields_read(stand_in, llama.tiny_config)) == \
        ["rope_scaling.new_knob", "sneaky_field"]

    def reads_an_alias(raw):  # read only where the field it stands for is missing, as require's aliases are
        if raw.get("num_hidden_layers") is None:
            raw.get("n_layers")
        return llama.parse_config(raw)

    def reads_in_its_weight_table(arch):
        arch.hf_config.get("table_switch")
        return llama.weight_rules(arch)

    stand_in = dataclasses.replace(llama, parse_config=reads_an_alias, weight_rules=reads_in_its_weight_table)
    assert undeclared(llama.config_keys, fields_read_without_each(stand_in, llama.tiny_config)) == \
        ["n_layers", "table_switch"]
    with pytest.raises(UserError, match=r"'rope_scaling.factor' must be a number"):
        parse_arch({**llama.tiny_config, "rope_scaling": {**llama.tiny_config["rope_scaling"], "factor": "4"}})
    qwen3_5 = families()["qwen3_5"].tiny_config
    with pytest.raises(UserError, match=r"'text_config.linear_num_key_heads' must be a whole number"):
        parse_arch({**qwen3_5, "text_config": {**qwen3_5["text_config"], "linear_num_key_heads": 2.5}})


@pytest.mark.parametrize("name", list(families()))
def test_a_family_derives_its_skeleton_or_says_why_not(name):
    from megatron_patch.models.shape import derived_skeleton as ds
    from megatron_patch.models.description.registry import parse_arch

    family = families()[name]
    try:
        ds.derive_skeleton(parse_arch(family.tiny_config))
    except ds.NotDerivable as why:
        assert family.skeleton_from_megatron_core, \
            f"{name}: conversions would ask megatron-core for the model skeleton (a helper process, 5-10 s) because " \
            f"{why}: teach models/derived_skeleton.py its modules, or set skeleton_from_megatron_core saying why"
    else:
        assert family.skeleton_from_megatron_core is None, \
            f"{name}'s skeleton derives from its weight table: drop skeleton_from_megatron_core"


def test_every_arch_field_is_modelled_by_the_derivation_or_named_as_not():
    import dataclasses

    from megatron_patch.models.shape import derived_skeleton as ds
    from megatron_patch.models.description.arch import Arch

    fields = {f.name for f in dataclasses.fields(Arch)}
    assert not ds._ARCH_FIELDS & ds.ARCH_FIELDS_NOT_MODELLED
    assert fields == ds._ARCH_FIELDS | ds.ARCH_FIELDS_NOT_MODELLED, \
        f"Arch fields {sorted(fields - ds._ARCH_FIELDS - ds.ARCH_FIELDS_NOT_MODELLED)}: add each to " \
        "derived_skeleton._ARCH_FIELDS (the rules model it) or ARCH_FIELDS_NOT_MODELLED; a family's own settings " \
        "belong in its FamilyConfig (Arch.family_config), not in a new Arch field"


def test_a_per_layer_field_is_read_whole_and_checked_layer_by_layer():
    """transformers 5's per_layer_config (layer numbers to tables) is the one field a reader may take whole: its keys
    are layer numbers, and each layer's table is checked by its declared fields, named by its path."""
    from megatron_patch.errors import UserError
    from megatron_patch.models.description.config_checks import Given, Whole, check_config_values

    rule = PerLayer({"head_dim": Whole(1, 10)})
    assert undeclared({"per_layer_config": rule}, {"per_layer_config", "per_layer_config.*"}) == []
    assert undeclared({"per_layer_config": Given()}, {"per_layer_config", "per_layer_config.*"}) == \
        ["per_layer_config.*"]
    check_config_values({"per_layer_config": {"05": {"head_dim": 4}}}, {"per_layer_config": rule})
    with pytest.raises(UserError, match=r"'per_layer_config\.05\.head_dim' must be"):
        check_config_values({"per_layer_config": {"05": {"head_dim": 0}}}, {"per_layer_config": rule})
    with pytest.raises(UserError, match="'per_layer_config' must map layer numbers to JSON objects"):
        check_config_values({"per_layer_config": {"x": 3}}, {"per_layer_config": rule})


def test_a_model_says_how_many_rows_per_sample_its_stages_send():
    """megatron-core sizes the tensor between pipeline stages from micro_batch_size: a family whose stages send
    more rows per sample (DeepSeek-V4's hyper-connection streams folded into the batch) sets
    ``pipeline_batch_factor`` on its model, found through megatron-core's wrappers (``.module``); 1 otherwise."""
    import torch

    from megatron_patch.models.blocks.builder import pipeline_batch_factor

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = torch.nn.Linear(2, 2)
    assert pipeline_batch_factor(Wrapper(Wrapper(model))) == 1
    model.pipeline_batch_factor = 4
    assert pipeline_batch_factor(model) == 4 and pipeline_batch_factor(Wrapper(Wrapper(model))) == 4
