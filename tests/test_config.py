"""trainer/config.py: recipes load and validate, overrides, and clear errors for bad keys and values."""
from __future__ import annotations

import pytest

from drafthead.trainer.config import RECIPES_DIR, ConfigError, RunConfig, load_config, parse_or_exit, to_yaml

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_recipes_exist():
    assert {"eagle3_smollm2", "eagle3_llama", "eagle3_qwen"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_loads_and_validates(name):
    cfg = load_config([f"recipe={name}"])
    assert isinstance(cfg, RunConfig)
    assert cfg.recipe == name
    assert cfg.capture.mode in ("online", "offline")
    assert cfg.drafter.family == ("eagle3" if name == "default" else name.split("_")[0])  # recipes: FAMILY_TARGET
    assert cfg.data.num_holdout > 0 and cfg.train.lr > 0
    if cfg.train.deepspeed:  # the named DeepSpeed config exists
        from drafthead.trainer.engines import resolve_deepspeed_config

        assert resolve_deepspeed_config(cfg.train.deepspeed)["zero_optimization"]["stage"] in (1, 2, 3)


def test_default_recipe_is_smollm2():
    cfg = load_config([])
    assert cfg.recipe == "eagle3_smollm2"
    assert cfg.target.name_or_path == "smollm2-135m-instruct"


def test_recipe_values_override_defaults_and_cli_overrides_recipe():
    cfg = load_config(["recipe=eagle3_qwen"])
    assert cfg.target.name_or_path == "Qwen/Qwen3-8B" and cfg.train.deepspeed == "zero2"
    assert cfg.data.enable_thinking is False
    cfg = load_config(["recipe=eagle3_qwen", "train.max_steps=4", "data.regenerate.enabled=true",
                       "data.regenerate.fraction=0.5", "capture.layer_ids=[1,2,3]", "train.deepspeed=null",
                       "train.betas=[0.9,0.99]"])
    assert cfg.train.max_steps == 4
    assert cfg.data.regenerate.enabled is True and cfg.data.regenerate.fraction == 0.5
    assert cfg.capture.layer_ids == [1, 2, 3]
    assert cfg.train.deepspeed is None
    assert cfg.train.betas == [0.9, 0.99]
    assert cfg.train.lr == 1e-4  # from the recipe, untouched


def test_gpu_recipes_train_on_the_targets_own_answers():
    """The GPU recipes regenerate by default (speculators' advice; `engine=auto` takes vLLM where its environment
    works); the CPU defaults and the tensor-parallel 70B recipe, which cannot regenerate on a split target, do not."""
    for name in RECIPES:
        cfg = load_config([f"recipe={name}"])
        gpu = name.endswith(("_qwen", "_qwen35", "_llama"))
        assert cfg.data.regenerate.enabled is gpu, name
        assert cfg.data.regenerate.engine == "auto", name


def test_resolved_yaml_loads_back(tmp_path):
    cfg = load_config(["recipe=eagle3_llama", "train.max_steps=7", "data.regenerate.enabled=true"])
    p = tmp_path / "config.yaml"
    p.write_text(to_yaml(cfg))
    again = load_config([f"recipe={p}"])
    assert again == cfg  # recipe name kept from the file, all values equal


def test_unknown_key_names_it_and_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.max_step'.*'train\.max_steps'"):
        load_config(["train.max_step=3"])
    with pytest.raises(ConfigError, match=r"'data\.regenerate\.enabeld'.*'data\.regenerate\.enabled'"):
        load_config(["data.regenerate.enabeld=true"])


def test_unknown_key_exits_nonzero(capsys):
    with pytest.raises(SystemExit) as e:
        parse_or_exit(["train.max_step=3"])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert "train.max_step" in err and "did you mean 'train.max_steps'" in err


def test_unknown_key_inside_a_recipe_file(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"train\.learning_rate"):
        load_config([f"recipe={p}"])


@pytest.mark.parametrize("arg,key", [("train.lr=abc", "train.lr"), ("train.max_steps=4.5", "train.max_steps"),
                                     ("data.regenerate.enabled=maybe", "data.regenerate.enabled")])
def test_mistyped_value_names_the_key(arg, key):
    with pytest.raises(ConfigError, match=rf"bad value for '{key}'"):
        load_config([arg])


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(ConfigError, match=r"unknown recipe 'nope'.*eagle3_llama.*eagle3_qwen.*eagle3_smollm2"):
        load_config(["recipe=nope"])


@pytest.mark.parametrize("arg,key,choices", [("capture.mode=foo", "capture.mode", "online, offline"),
                                             ("data.overlong=cut", "data.overlong", "truncate, skip"),
                                             ("train.resume=maybe", "train.resume", "auto, true, false")])
def test_bad_choice_values(arg, key, choices):
    with pytest.raises(ConfigError, match=rf"bad value for '{key}'.*\(choose from {choices}\)"):
        load_config([arg])


def test_bad_ranges_and_argument_shape():
    with pytest.raises(ConfigError, match=r"data\.max_length"):
        load_config(["data.max_length=2"])
    with pytest.raises(ConfigError, match=r"drafter\.eagle3\.num_draft_tokens"):
        load_config(["drafter.eagle3.num_draft_tokens=0"])
    with pytest.raises(ConfigError,
                       match=r"bad value for 'drafter\.eagle3\.feature_loss_weight': -0\.5 \(must be >= 0\)"):
        load_config(["drafter.eagle3.feature_loss_weight=-0.5"])
    with pytest.raises(ConfigError,
                       match=r"bad value for 'drafter\.eagle3\.hard_label_weight': 1\.5 \(must be in \[0, 1\]\)"):
        load_config(["drafter.eagle3.hard_label_weight=1.5"])
    with pytest.raises(ConfigError, match=r"bad value for 'drafter\.eagle3\.fc_norm': Value 'maybe'"):
        load_config(["drafter.eagle3.fc_norm=maybe"])
    # EAGLE 3.1 is EAGLE3's
    with pytest.raises(ConfigError, match=r"unknown config key 'drafter\.dflash\.norm_output'"):
        load_config(["recipe=dflash_smollm2", "drafter.dflash.norm_output=true"])
    # a family's key given without its section: named, with the section it belongs to
    with pytest.raises(ConfigError,
                       match=r"unknown config key 'drafter\.draft_vocab_size'.*'drafter\.eagle3\.draft_vocab_size'"):
        load_config(["drafter.draft_vocab_size=64"])
    # another family's option (a Domino key on an EAGLE3 run) would be read by nothing: named before anything loads
    with pytest.raises(ConfigError, match=r"'drafter\.domino\.gru_hidden_dim' is an option of the domino drafter, "
                                          r"but this run trains drafter\.family=eagle3: set drafter\.family=domino"):
        load_config(["drafter.domino.gru_hidden_dim=128"])
    assert load_config(["recipe=domino_smollm2", "drafter.domino.gru_hidden_dim=128"]).drafter.domino.gru_hidden_dim \
        == 128
    with pytest.raises(ConfigError, match=r"'drafter\.dflash\.num_anchors' is an option of the dflash drafter, "
                                          r"but this run trains drafter\.family=domino"):
        load_config(["recipe=domino_smollm2", "drafter.dflash.num_anchors=64"])
    with pytest.raises(ConfigError, match=r"key=value.*'max_steps'"):
        load_config(["max_steps"])
    with pytest.raises(ConfigError, match=r"key=value \(or --help\), got \[.=4.\]"):  # a value without its key
        load_config(["=4"])
    assert load_config(["recipe=default"]).recipe == "default"  # the embedded default under its alias
    assert load_config(["recipe=default"]).drafter.family == load_config([]).drafter.family == "eagle3"


def test_resume_accepts_bool_spellings():
    assert load_config(["train.resume=true"]).train.resume.lower() == "true"
    assert load_config(["train.resume=False"]).train.resume.lower() == "false"


def test_train_loss_is_checked_against_the_family():
    assert load_config(["train.loss=lk_hybrid"]).train.loss == "lk_hybrid"
    assert load_config(["recipe=dflash_smollm2", "train.loss=lk_alpha"]).train.loss == "lk_alpha"
    with pytest.raises(ConfigError, match=r"'train\.loss': 'ce' \(drafter\.family=eagle3 takes kl, lk_alpha"):
        load_config(["train.loss=ce"])
    with pytest.raises(ConfigError, match=r"'train\.loss': 'tv' \(drafter\.family=dspark trains its own loss"):
        load_config(["recipe=dspark_smollm2", "train.loss=tv"])
    with pytest.raises(ConfigError, match=r"'train\.lk_kl_scale'.*in \(0, 1\]"):
        load_config(["train.loss=lk_hybrid", "train.lk_kl_scale=1.5"])
