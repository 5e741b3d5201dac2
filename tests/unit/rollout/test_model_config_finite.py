"""The checkpoint loader refuses a non-finite config value, naming the field: ``json`` reads
``"rope_theta": 1e400`` as inf (and accepts ``NaN`` / ``Infinity``), which no model means and no
strict JSON writer can write back (the SGLang engine's weight directory ``config.json``)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from replayrl.rollout.model import ModelConfigError, default_config
from replayrl.rollout.model.hf_config import read_hf_config


def _write(tmp_path, text: str):
    (tmp_path / "config.json").write_text(text)
    return tmp_path


def _hf_text(**replace: str) -> str:
    """A valid config.json text with some top-level values replaced by raw JSON text."""
    hf = default_config(64).to_hf_dict()
    marks = {key: f"@@{key}@@" for key in replace}
    text = json.dumps({**hf, **marks})
    for key, raw in replace.items():
        text = text.replace(f'"@@{key}@@"', raw)
    return text


def test_the_valid_text_loads(tmp_path):
    assert read_hf_config(_write(tmp_path, _hf_text())).rope_theta == default_config(64).rope_theta


@pytest.mark.parametrize("raw", ["1e400", "-1e400", "Infinity", "NaN"])
def test_loader_refuses_a_non_finite_rope_theta_naming_it(tmp_path, raw):
    assert not math.isfinite(json.loads(raw))  # what plain json makes of it
    with pytest.raises(ModelConfigError, match=r"field 'rope_theta'=.* is not finite"):
        read_hf_config(_write(tmp_path, _hf_text(rope_theta=raw)))


def test_loader_names_a_nested_non_finite_field(tmp_path):
    text = _hf_text(rms_norm_eps="1e-6", rope_scaling='{"rope_type": "linear", "factor": 1e999}')
    with pytest.raises(ModelConfigError, match=r"field 'rope_scaling\.factor'=inf is not finite"):
        read_hf_config(_write(tmp_path, text))


@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps"])
def test_model_config_refuses_non_finite_floats(field):
    with pytest.raises(ModelConfigError, match=rf"ModelConfig\.{field} must be finite"):
        dataclasses.replace(default_config(64), **{field: math.inf})
