"""Which checkpoint tensors make each model entry, worked out by rank 0 before a load (_load._compositions):
where the checkpoint holds every name the load reads, nothing composes and transformers' conversion rules
are not asked for (transformers builds every model type's rules at their first use); where a name is
missing, the rules are asked and explain it. Real safetensors files, written by the reference library."""
import pytest
import torch
from safetensors.torch import save_file

from shardcast import _load, _mapping


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))                        # persistent: in the checkpoint
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)   # computed, never in a checkpoint


def _checkpoint(tmp_path, **tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def _rules_must_not_be_asked(model):
    raise AssertionError("conversion rules asked for, though the checkpoint holds every name the load reads")


def test_a_checkpoint_holding_every_name_composes_nothing_without_asking_for_rules(tmp_path, monkeypatch):
    monkeypatch.setattr(_mapping, "conversion_rules", _rules_must_not_be_asked)
    path = _checkpoint(tmp_path, **{"proj.weight": torch.ones(3, 4), "proj.bias": torch.ones(3), "scale": torch.ones(3)})
    assert _load._compositions(_Tiny(), path) == {}  # the non-persistent inv_freq is not asked of the checkpoint


def test_a_name_the_checkpoint_lacks_asks_for_the_rules_and_they_explain_it(tmp_path, monkeypatch):
    class Renamed:  # a transformers-like renaming: checkpoint "proj.w" is the model's "proj.weight"
        def rename_source_key(self, key):
            return key.replace("proj.w", "proj.weight") if key.endswith("proj.w") else key, None

    asked = []
    monkeypatch.setattr(_mapping, "conversion_rules", lambda model: asked.append(model) or [Renamed()])
    monkeypatch.setattr("transformers.core_model_loading.apply_renamings",
                        lambda key, rules: rules[0].rename_source_key(key)[0], raising=False)
    path = _checkpoint(tmp_path, **{"proj.w": torch.ones(3, 4), "proj.bias": torch.ones(3), "scale": torch.ones(3)})
    assert _load._compositions(_Tiny(), path) == {"proj.weight": ["proj.w"]}
    assert len(asked) == 1


@pytest.mark.parametrize("missing", ["proj.bias", "scale"])
def test_a_missing_parameter_or_persistent_buffer_is_left_to_the_load_to_name(tmp_path, monkeypatch, missing):
    asked = []
    monkeypatch.setattr(_mapping, "conversion_rules", lambda model: asked.append(model) or [])
    held = {"proj.weight": torch.ones(3, 4), "proj.bias": torch.ones(3), "scale": torch.ones(3)}
    del held[missing]
    assert _load._compositions(_Tiny(), _checkpoint(tmp_path, **held)) == {}  # nothing explains it: the C++
    assert len(asked) == 1                                                    # core names it as missing
