"""The conventional API (issue 33): everything after the path is keyword-only, the source has one name
(save's mode= is a deprecated alias of source=), and load's strict= carries load_state_dict(strict=True)'s
meaning (strict_keys= is its deprecated alias). One process, a world of one: fast."""
import inspect
import warnings

import pytest
import torch
from safetensors.torch import save_file

import shardcast


@pytest.fixture
def checkpoint(tmp_path):
    """A Linear's checkpoint with one key no model owns ("extra")."""
    torch.manual_seed(0)
    save_file({"weight": torch.randn(3, 4), "bias": torch.randn(3), "extra": torch.zeros(2)},
              str(tmp_path / "model.safetensors"))
    return tmp_path


def _keyword_only_after(fn, first_positional):
    params = list(inspect.signature(fn).parameters.values())
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert positional == first_positional, (fn.__name__, positional)
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params[len(positional):])


def test_everything_after_the_path_is_keyword_only():
    _keyword_only_after(shardcast.load, ["model", "path"])
    _keyword_only_after(shardcast.save, ["model", "out_dir"])
    _keyword_only_after(shardcast.from_pretrained, ["path_or_local_repo_id"])


def test_an_option_passed_by_position_is_a_type_error(checkpoint, tmp_path):
    model = torch.nn.Linear(4, 3)
    with pytest.raises(TypeError):
        shardcast.load(model, checkpoint, "each-rank")
    with pytest.raises(TypeError):
        shardcast.save(model, tmp_path / "out", "rank0")
    with pytest.raises(TypeError):
        shardcast.from_pretrained(checkpoint, None)
    assert not (tmp_path / "out").exists()


def test_strict_rejects_a_checkpoint_key_the_model_does_not_own(checkpoint):
    with pytest.raises(shardcast.ManifestMismatch, match="'extra'"):
        shardcast.load(torch.nn.Linear(4, 3), checkpoint, strict=True)


def test_by_default_and_with_strict_false_extra_keys_are_skipped_and_counted(checkpoint):
    for kwargs in ({}, {"strict": False}):
        model = torch.nn.Linear(4, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no deprecation on the new names
            report = shardcast.load(model, checkpoint, **kwargs)
        assert report["skipped_keys"] == 1, report


def test_a_model_key_the_checkpoint_lacks_is_an_error_whatever_strict_says(checkpoint):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))  # keys "0.weight", "0.bias": absent
    for strict in (True, False):
        with pytest.raises(shardcast.ShardcastError, match="0.weight"):
            shardcast.load(model, checkpoint, strict=strict)


def test_strict_keys_is_a_deprecated_alias_of_strict(checkpoint):
    with pytest.warns(DeprecationWarning, match="strict="):
        with pytest.raises(shardcast.ManifestMismatch, match="'extra'"):
            shardcast.load(torch.nn.Linear(4, 3), checkpoint, strict_keys=True)
    with pytest.warns(DeprecationWarning, match="strict="):
        assert shardcast.load(torch.nn.Linear(4, 3), checkpoint, strict_keys=False)["skipped_keys"] == 1


def test_strict_and_strict_keys_that_disagree_are_an_invalid_argument(checkpoint):
    with pytest.warns(DeprecationWarning):
        with pytest.raises(shardcast.InvalidArgument, match="disagree"):
            shardcast.load(torch.nn.Linear(4, 3), checkpoint, strict=True, strict_keys=False)


def test_save_takes_source_and_mode_is_its_deprecated_alias(tmp_path):
    model = torch.nn.Linear(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shardcast.save(model, tmp_path / "a", source="rank0")["mode"] == "rank0"
        assert shardcast.save(model, tmp_path / "b")["mode"] == "each-rank"  # the default, as before
    with pytest.warns(DeprecationWarning, match="source="):
        assert shardcast.save(model, tmp_path / "c", mode="rank0")["mode"] == "rank0"
    with pytest.warns(DeprecationWarning):
        with pytest.raises(shardcast.InvalidArgument, match="disagree"):
            shardcast.save(model, tmp_path / "d", source="each-rank", mode="rank0")
    assert not (tmp_path / "d").exists()


def test_a_wrongly_typed_option_is_an_invalid_argument_naming_it(checkpoint, tmp_path):
    with pytest.raises(shardcast.InvalidArgument, match="staging_slots"):
        shardcast.load(torch.nn.Linear(4, 3), checkpoint, staging_slots=object())
    with pytest.raises(shardcast.InvalidArgument, match="timeout"):
        shardcast.load(torch.nn.Linear(4, 3), checkpoint, timeout="soon")
    with pytest.raises(shardcast.InvalidArgument, match="progress"):
        shardcast.load(torch.nn.Linear(4, 3), checkpoint, progress="yes")
    with pytest.raises(shardcast.InvalidArgument, match="chunk_bytes"):
        shardcast.save(torch.nn.Linear(4, 3), tmp_path / "out", chunk_bytes=[1])


def test_the_binding_turns_a_wrongly_typed_argument_into_an_invalid_argument(checkpoint):
    from shardcast import _shardcast
    cases = [
        dict(options={"staging_slots": 4}),                       # an int where the binding takes text
        dict(entries=[("weight", [1.0, 2.0], [3, 4], "parameter", -1, None)]),  # a list for a tensor
        dict(entries=[("weight",)]),                              # a short tuple
        dict(tied={"a": 1}),
        dict(checkpoint=7),
        dict(progress="yes"),
    ]
    for override in cases:
        args = dict(entries=[], layouts=[], checkpoint=str(checkpoint), options={}, tied={}, store=None, rank=0,
                    world_size=1)
        args.update(override)
        with pytest.raises(shardcast.InvalidArgument, match="rank 0"):
            _shardcast.load_entries(**args)


def test_from_pretrained_reads_dtype_auto_as_transformers_does(tmp_path):
    """dtype="auto" (transformers' idiom): the config's dtype, else the checkpoint's first floating tensor's;
    anything that is not a floating torch.dtype, "auto" or None is an InvalidArgument naming it."""
    from types import SimpleNamespace
    from shardcast._world import _model_dtype
    save_file({"a.idx": torch.zeros(2, dtype=torch.int32), "b.weight": torch.zeros(2, dtype=torch.float16)},
              str(tmp_path / "model.safetensors"))
    assert _model_dtype("auto", SimpleNamespace(dtype="bfloat16"), str(tmp_path)) == torch.bfloat16
    assert _model_dtype("auto", SimpleNamespace(torch_dtype=torch.float32), str(tmp_path)) == torch.float32
    assert _model_dtype("auto", SimpleNamespace(dtype=None), str(tmp_path)) == torch.float16
    assert _model_dtype(None, None, str(tmp_path)) is None
    for bad, words in (("float16", "dtype='float16'"), (torch.int8, "floating dtype"), (16, "dtype=16")):
        with pytest.raises(shardcast.InvalidArgument, match=words):
            _model_dtype(bad, SimpleNamespace(dtype="bfloat16"), str(tmp_path))


def test_from_pretrained_names_a_keyword_load_does_not_take(tmp_path):
    with pytest.raises(shardcast.InvalidArgument, match="strict_key.*takes"):
        shardcast.from_pretrained(str(tmp_path), strict_key=True)


def test_dir_lists_the_package_names_not_its_implementation_tools():
    names = set(dir(shardcast))
    assert {"from_pretrained", "load", "save", "prepare", "LoadReport", "ShardcastError", "__version__"} <= names
    assert not names & {"annotations", "importlib", "TYPE_CHECKING"}, sorted(names)
