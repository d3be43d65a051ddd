"""transformers' config-class defaults for the fields a config.json leaves out, filled in before a family parses it.

transformers builds a model from its config class, whose default stands in for every field config.json omits; a
family whose own fallback differs would build another model, silently (Qwen3's head_dim: 128, not hidden / heads).
Each family keeps those defaults as a literal table, ``HF_DEFAULTS`` (model_type -> field -> transformers' default,
for the fields it reads whose fallback would differ; literal so that a conversion imports neither torch nor
transformers), and reads config.json through ``reads_hf_defaults``. tests/test_hub_configs.py holds every table to
transformers, so a release that changes a default, or a new field, fails there.

Only absent fields are filled: an explicit JSON ``null`` is transformers' None too, which its classes (and the
families) read as "derive it" (``num_key_value_heads: null``: one per query head) or "none" (``q_lora_rank: null``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace
from typing import Callable, Mapping

from megatron_patch.models.description.arch import Arch


def hf_values(raw: dict, table: Mapping[str, object]) -> dict:
    """``raw`` with each field of ``table`` it lacks set to the table's value."""
    missing = {key: copy.deepcopy(value) for key, value in table.items() if key not in raw}
    return raw | missing if missing else raw


def config_as_transformers_reads(raw: dict, defaults: Mapping[str, Mapping[str, object]],
                                 within: str | None = None) -> dict:
    """config.json with its model_type's defaults filled in; ``within``: a multimodal config keeps the language
    model's fields in that nested table (Qwen3.5's text_config), where the defaults then go."""
    table = defaults.get(raw.get("model_type"), {})
    if within is None:
        return hf_values(raw, table)
    nested = raw.get(within)
    # without its table the config.json is not the family's to read (it refuses it): nothing is filled in
    return raw | {within: hf_values(nested, table)} if isinstance(nested, dict) else raw


def reads_hf_defaults(defaults: Mapping[str, Mapping[str, object]], within: str | None = None) -> Callable:
    """A family's ``parse_config`` that reads config.json as transformers does (``config_as_transformers_reads``);
    the Arch keeps config.json as given (``hf_config``: what a checkpoint records and an export writes back). The
    table stays on the function (``hf_defaults``), where ``ModelFamily.hf_defaults`` finds it."""
    def wrap(parse: Callable[[dict], Arch]) -> Callable[[dict], Arch]:
        @functools.wraps(parse)
        def parse_config(raw: dict) -> Arch:
            return replace(parse(config_as_transformers_reads(raw, defaults, within)), hf_config=raw)

        parse_config.hf_defaults, parse_config.hf_defaults_within = defaults, within
        return parse_config
    return wrap
