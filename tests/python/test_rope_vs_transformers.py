"""shardcast's locally computed RoPE buffers against what transformers itself computes, for the
published configs shardcast plans for (llama3, YaRN with attention scaling, MiniMax-M2's partial
rotary, DeepSeek's MLA rope dim): within 1 ulp of float32."""
import json
import pathlib

import pytest

import torch
import transformers  # noqa: F401
import shardcast

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "models"


def ulps(a, b):
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_inv_freq_matches_transformers(name):
    from transformers import AutoConfig, AutoModelForCausalLM
    path = CONFIGS / name
    raw = json.loads(path.read_text())
    raw.pop("quantization_config", None)  # dims only: no quantizer needed to build the rotary module
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    rotary = type(model.model.rotary_emb)(config=config)  # transformers computes it, on CPU
    for buffer in ("inv_freq", "original_inv_freq"):
        theirs = getattr(rotary, buffer)
        ours = torch.zeros_like(theirs)
        note = shardcast._shardcast.init_buffer(json.dumps(raw), str(path), f"model.rotary_emb.{buffer}", ours)
        assert ours.shape == theirs.shape, (name, buffer)
        assert ulps(ours, theirs) <= 1, (name, buffer, ulps(ours, theirs))
    scaling = float(note.rsplit(" ", 1)[-1])
    assert scaling == pytest.approx(rotary.attention_scaling, rel=1e-6), (name, note, rotary.attention_scaling)
