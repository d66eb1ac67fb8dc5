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


# Models whose one rotary module holds "<layer type>_inv_freq" per attention type (transformers >= 5), with
# each type's own rope_parameters: Gemma 3's published layout (local 10k default, global 1M linear x8),
# OLMo 3's YaRN on every type; the composite Gemma 3 (text_config) as its ForConditionalGeneration saves it.
LAYER_TYPES = {
    "gemma3_text": dict(head_dim=16, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}),
    "olmo3": dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096, rope_parameters={
        t: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0, "original_max_position_embeddings": 1024,
            "attention_factor": 1.2, "beta_fast": 32.0, "beta_slow": 1.0} for t in ("sliding_attention", "full_attention")}),
}


@pytest.mark.parametrize("model_type", sorted(LAYER_TYPES) + ["gemma3 (text_config)"])
def test_inv_freq_per_layer_type_matches_transformers(model_type):
    from transformers import AutoConfig
    composite = model_type.startswith("gemma3 ")
    name = "gemma3_text" if composite else model_type
    config = AutoConfig.for_model(name, num_hidden_layers=6, **LAYER_TYPES[name])
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}, config.layer_types
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding
    rotary_cls = Gemma3RotaryEmbedding if name == "gemma3_text" else Olmo3RotaryEmbedding
    rotary = rotary_cls(config=config)  # transformers computes every type's buffers, on CPU
    saved = config.to_dict()
    if composite:
        saved = {"model_type": "gemma3", "text_config": saved}
    prefix = "model.language_model.rotary_emb" if composite else "model.rotary_emb"
    names = [n for n, _ in rotary.named_buffers()]
    assert sorted(names) == sorted(f"{t}{o}_inv_freq" for t in ("sliding_attention", "full_attention")
                                   for o in ("", "_original")), names
    for buffer in names:
        theirs = getattr(rotary, buffer)
        ours = torch.zeros_like(theirs)
        note = shardcast._shardcast.init_buffer(json.dumps(saved), model_type, f"{prefix}.{buffer}", ours)
        assert ulps(ours, theirs) <= 1, (model_type, buffer, ulps(ours, theirs))
        layer_type = buffer.removesuffix("_inv_freq").removesuffix("_original")
        assert float(note.rsplit(" ", 1)[-1]) == pytest.approx(
            getattr(rotary, f"{layer_type}_attention_scaling"), rel=1e-6), note


def test_a_layer_type_the_config_has_no_rope_parameters_for_is_a_config_error():
    from transformers import AutoConfig
    saved = AutoConfig.for_model("gemma3_text", **LAYER_TYPES["gemma3_text"]).to_dict()
    with pytest.raises(shardcast.ConfigError, match="layer type 'chunked_attention'.*rope_parameters"):
        shardcast._shardcast.init_buffer(json.dumps(saved), "cfg.json", "model.rotary_emb.chunked_attention_inv_freq",
                                         torch.zeros(8))


def _per_type(**rope_parameters):
    from transformers import AutoConfig
    return AutoConfig.for_model("olmo3", hidden_size=64, num_attention_heads=4, num_hidden_layers=4,
                                max_position_embeddings=4096, rope_parameters=rope_parameters)


def _rotary(config):
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding
    return Olmo3RotaryEmbedding(config=config)


def test_a_top_level_rope_theta_stands_in_for_a_type_without_one():
    """A raw config (a dict given to prepare) whose per-type entries carry no rope_theta: transformers'
    standardization fills them from the top level; so does the rule."""
    config = _per_type(sliding_attention={"rope_type": "default"}, full_attention={"rope_type": "default"})
    raw = config.to_dict()
    raw["rope_theta"] = 1e6
    for entry in raw["rope_parameters"].values():
        entry.pop("rope_theta", None)
    theirs = _rotary(type(config).from_dict(raw)).full_attention_inv_freq
    ours = torch.zeros_like(theirs)
    shardcast._shardcast.init_buffer(json.dumps(raw), "raw", "model.rotary_emb.full_attention_inv_freq", ours)
    assert ulps(ours, theirs) <= 1, (ours, theirs)


def test_yarn_per_type_truncates_as_transformers_does_whatever_the_entry_says():
    """transformers reads YaRN's `truncate` from the per-type table, never from a type's entry."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    config = _per_type(sliding_attention=dict(yarn), full_attention=dict(yarn))
    theirs = _rotary(config).full_attention_inv_freq
    ours = torch.zeros_like(theirs)
    shardcast._shardcast.init_buffer(json.dumps(config.to_dict()), "cfg", "model.rotary_emb.full_attention_inv_freq",
                                     ours)
    assert ulps(ours, theirs) <= 1, ulps(ours, theirs)


def test_a_vision_towers_rotary_buffer_is_not_computed_from_the_text_config():
    """A composite config's text_config holds the language model's RoPE; a vision tower's rotary buffer keeps
    the top level (transformers computes it from vision_config by the tower's own rule)."""
    composite = {"model_type": "x", "text_config": {"rope_theta": 5e6, "max_position_embeddings": 4096},
                 "vision_config": {}}
    text, vision, plain = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    init = shardcast._shardcast.init_buffer
    init(json.dumps(composite), "cfg", "model.language_model.rotary_emb.inv_freq", text)
    init(json.dumps(composite), "cfg", "model.vision_tower.rotary_emb.inv_freq", vision)
    init(json.dumps({"model_type": "x"}), "cfg", "model.rotary_emb.inv_freq", plain)
    assert torch.equal(vision, plain) and not torch.equal(text, plain)


def test_a_rule_that_cannot_compute_a_buffer_names_it_and_says_where_buffer_init_goes():
    from transformers import AutoModelForCausalLM
    config = _per_type(sliding_attention={"rope_type": "default", "rope_theta": 1e4},
                       full_attention={"rope_type": "default", "rope_theta": 1e4})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    raw = config.to_dict()
    raw["rope_parameters"]["full_attention"]["rope_type"] = "proportional"
    with pytest.raises(shardcast.ConfigError, match="'model.rotary_emb.full_attention_inv_freq'.*proportional.*buffer_init"):
        shardcast.prepare(model, config=raw)
