"""The config tree: defaults, YAML mirror, the override grammar, aliases and every validation error."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from rlhf_core.config import ConfigError, PPOConfig, attribute, load_config, reward_training_batch_problems


def _errors_or_none(*overrides: str) -> str | None:
    try:
        load_config(list(overrides), notice=lambda _: None, validate=False)
    except ConfigError as exc:
        return "\n".join(exc.errors)
    return None


def _errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(overrides), notice=lambda _: None)
    return "\n".join(info.value.errors)


def test_defaults_are_valid_and_match_verl():
    cfg = load_config([])
    assert cfg.data.train_batch_size == 1024
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.critic.optim.lr == 1e-5
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.trainer.profile_dir == "checkpoints/verl_examples/gsm8k/profile"  # an interpolation of one
    assert cfg.world_size == 8


def _dataclass_tree(instance, prefix=""):
    """(dotted key, default, help) of every key and section, read from the dataclass fields themselves."""
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        yield f"{prefix}{f.name}", value, f.metadata["help"]
        if dataclasses.is_dataclass(value):
            yield from _dataclass_tree(value, f"{prefix}{f.name}.")


def _yaml_comments(text):
    """dotted key -> the comment written on its line, from the indentation (two spaces a level)."""
    comments, stack = {}, []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        stack[depth:] = [line.strip().split(":", 1)[0]]
        comments[".".join(stack)] = line.partition("  # ")[2].strip()
    return comments


def test_yaml_file_holds_every_key_with_its_default_and_its_comment(repo_root):
    text = (repo_root / "configs" / "ppo_trainer.yaml").read_text()
    regenerate = "regenerate with: python -m rlhf_core.config --defaults > configs/ppo_trainer.yaml"
    tree, comments = yaml.safe_load(text), _yaml_comments(text)
    expected = list(_dataclass_tree(PPOConfig()))
    assert len(expected) > 150
    assert sorted(comments) == sorted(key for key, _, _ in expected), regenerate
    for key, default, help_text in expected:
        assert help_text and comments[key] == help_text, f"{key}: comment {comments[key]!r}; {regenerate}"
        if not dataclasses.is_dataclass(default):
            node = tree
            for part in key.split("."):
                node = node[part]
            assert node == default and type(node) is type(default), f"{key}: {node!r} != {default!r}; {regenerate}"
    assert load_config(config_file=repo_root / "configs" / "ppo_trainer.yaml") == load_config([])


def test_help_lists_the_names_the_registries_hold():
    from rlhf_core import algos
    from rlhf_core.training.tracking import VALID_LOGGERS

    helps = {key: help_text for key, _, help_text in _dataclass_tree(PPOConfig())}
    assert helps["algorithm.adv_estimator"].split(" | ") == list(algos.ADV_ESTIMATORS)
    assert helps["actor_rollout_ref.actor.loss_agg_mode"].split(" | ") == list(algos.LOSS_AGG_MODES)
    assert helps["critic.loss_agg_mode"].removesuffix("; null = the actor's").split(" | ") == list(algos.LOSS_AGG_MODES)
    assert helps["trainer.logger"].split(" | ") == list(VALID_LOGGERS)
    assert helps["algorithm.kl_ctrl.type"].endswith(" | ".join(algos.KL_CTRL_TYPES))


def test_overrides_are_typed():
    cfg = load_config(
        [
            "actor_rollout_ref.actor.optim.lr=1e-5",  # YAML 1.1 would read this as a string
            "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
            "data.train_batch_size=512",
            "critic.optim.weight_decay=0",
            "trainer.logger=[console,file]",
            "data.train_files=[a.parquet,b.parquet]",
            "data.val_files=c.parquet",
            "trainer.total_training_steps=null",
            "actor_rollout_ref.actor.clip_ratio_low=null",
            "trainer.experiment_name=run7",
            "trainer.warn_kl=0.5",
        ]
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5 and isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.9, 0.95]
    assert cfg.data.train_batch_size == 512
    assert cfg.critic.optim.weight_decay == 0.0 and isinstance(cfg.critic.optim.weight_decay, float)
    assert cfg.trainer.logger == ["console", "file"] and type(cfg.trainer.logger) is list
    assert cfg.data.train_files == ["a.parquet", "b.parquet"] and type(cfg.data.train_files) is list
    assert cfg.data.val_files == "c.parquet"
    assert cfg.trainer.total_training_steps is None
    assert cfg.actor_rollout_ref.actor.clip_ratio_low is None
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/run7"
    assert cfg.trainer.warn_kl == 0.5


@pytest.mark.parametrize(
    "typed",
    [
        "trainer.logger=[console,wandb]",
        'trainer.logger=["console","wandb"]',
        "trainer.logger='[console,wandb]'",  # as typed in a shell, which removes the quotes
        """trainer.logger='["console","wandb"]'""",  # verl's example scripts
        "'trainer.logger=[ console , wandb ]'",
    ],
)
def test_both_list_syntaxes(typed):
    (override,) = shlex.split(typed)
    assert load_config([override]).trainer.logger == ["console", "wandb"]


def test_tilde_key_restores_the_default(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  seed: 7\n  guard:\n    patience: 9\n    max_kl: 3.0\n")
    cfg = load_config(["~trainer.seed", "~trainer.guard", "trainer.experiment_name=x", "~trainer.experiment_name"],
                      config_file=path)
    assert cfg.trainer.seed == 1
    assert (cfg.trainer.guard.patience, cfg.trainer.guard.max_kl) == (3, 1.0)
    assert cfg.trainer.experiment_name == "gsm8k"
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    assert "unknown config key trainer.sed; did you mean trainer.seed?" in _errors("~trainer.sed")
    assert "write ~trainer.seed" in _errors("~trainer.seed=7")


def test_plus_key_sets_a_known_key_and_rejects_an_unknown_one():
    cfg = load_config(["+trainer.seed=5", "++data.seed=6"])
    assert (cfg.trainer.seed, cfg.data.seed) == (5, 6)
    message = _errors("+actor_rollout_ref.actor.clip_ratio_hgih=0.3")
    assert "unknown config key actor_rollout_ref.actor.clip_ratio_hgih" in message
    assert "did you mean actor_rollout_ref.actor.clip_ratio_high?" in message


def test_interpolations_follow_the_keys_they_name():
    cfg = load_config(["trainer.project_name=proj", "trainer.experiment_name=exp"])
    assert cfg.trainer.default_local_dir == "checkpoints/proj/exp"
    assert cfg.trainer.profile_dir == "checkpoints/proj/exp/profile"
    cfg = load_config(["trainer.default_local_dir=/out/${trainer.experiment_name}-${trainer.seed}", "trainer.seed=3"])
    assert cfg.trainer.default_local_dir == "/out/gsm8k-3"
    assert cfg.trainer.profile_dir == "/out/gsm8k-3/profile"


def test_the_keys_that_stand_for_others_resolve_through_chains_and_leave_the_config_as_given():
    cfg = load_config(["actor_rollout_ref.model.path=/m/policy", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                       "actor_rollout_ref.actor.ppo_epochs=3", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                       "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096", "data.max_response_length=96",
                       "critic.ppo_epochs=2", "critic.model.path=/m/critic",
                       "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1024"])
    resolved = cfg.resolved()
    arr, critic = resolved.actor_rollout_ref, resolved.critic
    # null: the value named, through a null in between (the critic's tokenizer: the actor's, then its model's)
    assert (critic.model.tokenizer_path, arr.model.tokenizer_path, resolved.data.tokenizer) == ("/m/policy",) * 3
    assert (critic.ppo_mini_batch_size, critic.use_dynamic_bsz) == (8, True)
    assert (arr.rollout.log_prob_use_dynamic_bsz, arr.rollout.log_prob_max_token_len_per_gpu) == (True, 4096)
    assert arr.actor.loss_scale_factor == 96
    # a value given stays
    assert (critic.ppo_epochs, critic.model.path, arr.ref.log_prob_max_token_len_per_gpu) == (2, "/m/critic", 1024)
    assert cfg.critic.ppo_mini_batch_size is None and cfg.data.tokenizer is None  # the config itself unchanged
    assert cfg.value("critic.model.tokenizer_path") == "/m/policy" and cfg.value("critic.ppo_epochs") == 2
    assert resolved.resolved() == resolved


def test_every_key_that_stands_for_another_names_a_key_that_exists_and_ends_in_a_value():
    from rlhf_core.config import FOLLOWS

    defaults = PPOConfig()
    for key, target in FOLLOWS.items():
        value = defaults
        for name in target.split("."):
            value = getattr(value, name)  # an AttributeError names a key that does not exist
        seen = {key}
        while target in FOLLOWS:  # a chain, never a loop
            assert target not in seen, key
            seen.add(target)
            target = FOLLOWS[target]
        assert defaults.value(key) is not None, key


def test_a_worker_refuses_a_section_with_a_key_left_to_stand_for_another():
    from rlhf_core.workers.critic import CriticWorker

    cfg = load_config([])  # refused before any model is looked for
    with pytest.raises(ValueError, match=r"critic.model.path, critic.model.tokenizer_path, .*critic.ppo_epochs.* "
                                         r"null: build the worker from PPOConfig.resolved\(\)'s critic"):
        CriticWorker(cfg.critic, "float32", total_steps=1)


def test_a_value_outside_the_grammar_asks_for_quotes():
    message = _errors("data.train_files=~/data/train.parquet")
    assert "override 'data.train_files=~/data/train.parquet' is not key=value" in message
    assert "quote a value" in message
    assert load_config(["data.train_files='~/data/train.parquet'"]).data.train_files == "~/data/train.parquet"
    assert "sweeps" in _errors("trainer.logger=console,wandb")


@pytest.mark.parametrize("text", ["configs/ppo_demo_cpu.yaml", "run.yml"])
def test_a_config_file_given_as_an_override_points_to_config(text):
    """``rlhf-ppo configs/x.yaml`` (the file without --config) was refused as a value outside the grammar, asking
    for quotes."""
    assert _errors(text) == (f"override {text!r} names a YAML file, not key=value: give a config file as --config "
                             f"{text} (in a pipeline's run config, as its trainer_config)")


@pytest.mark.parametrize("text", ["=3", "+=3", "~"])
def test_an_override_without_a_key_says_so(text):
    """'=3' (a key lost to the shell, a stray space before '=') was refused as 'unknown config key ' naming nothing."""
    assert _errors(text) == (f"override {text!r} names no key: write key=value (e.g. "
                             "trainer.total_training_steps=3), +key=value or ~key")


@pytest.mark.parametrize(("text", "said"), [
    ("42\n", ""), ("true\n", ""), ("[a, b]\n", ""),
    ("trainer.seed=3\ndata.seed=2\n", ", not the text 'trainer.seed=3 data.seed=2': write each key under its section "
     "(trainer:, then seed: 3 indented), or give key=value overrides on the command line")])
def test_a_config_file_that_is_not_a_mapping_is_refused_in_one_line(tmp_path, text, said):
    """A file of one number came out as OmegaConf's OSError (a traceback), and a file of overrides one a line as the
    unknown key 'trainer.seed=3 data.seed=2' (YAML reads the lines as one text, OmegaConf that text as a key)."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(config_file=path)
    assert info.value.errors == [f"config file {path} must hold a mapping of config keys{said}"]


@pytest.mark.parametrize(("text", "said"), [
    ('"": 3\n', "the top level has a key that is empty ('')"),
    ('trainer:\n  "": 1\n', "trainer has a key that is empty ('')"),
    ("trainer:\n  seed: 1\n  '':\n    logger: [console]\n", "trainer has a key that is empty ('')"),
    ('custom_reward_function:\n  reward_kwargs:\n    "": 2\n',
     "custom_reward_function.reward_kwargs has a key that is empty ('')"),
    ('actor_rollout_ref:\n  actor:\n    "  ": 1\n', "actor_rollout_ref.actor has a key that is blank ('  ')"),
    ("~: 3\n", "the top level has a key that is null (null or ~ written as a key)"),
    ("trainer:\n  null: 1\n", "trainer has a key that is null (null or ~ written as a key)")])
def test_a_config_files_empty_or_null_key_is_named_with_its_section(tmp_path, text, said):
    """A key that is the empty string was refused as 'unknown config key trainer.' with a near name ('did you mean
    trainer.seed?') that was no help, or, at the top level, as 'unknown config key ' naming nothing; a null key came
    out as OmegaConf's KeyValidationError (a traceback)."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(config_file=path)
    assert info.value.errors == [f"config file {path}: {said}: write the key's name, or remove that line"]


def test_a_config_files_section_left_empty_says_so(tmp_path):
    """A section whose keys were all commented out (``trainer:`` and nothing under it) reads as null: OmegaConf's
    "field 'trainer' is not Optional" named no fix."""
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n#  seed: 3\nactor_rollout_ref:\n  actor:\n")
    with pytest.raises(ConfigError) as info:
        load_config(config_file=path)
    assert info.value.errors == [f"trainer is empty (null): put its keys under it, or leave it out (in {path})",
                                 "actor_rollout_ref.actor is empty (null): put its keys under it, or leave it out "
                                 f"(in {path})"]


def test_yaml_file_reads_yaml_1_1_floats_and_null(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-5\n    clip_ratio_high: 3e-1\n"
                    "trainer:\n  warn_kl: null\n  logger: [console, file]\n")
    cfg = load_config(config_file=path)
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.3
    assert cfg.trainer.warn_kl is None
    assert cfg.trainer.logger == ["console", "file"]


def test_the_dict_form_round_trips_and_is_validated():
    cfg = load_config(["trainer.logger=[console,file]", "data.train_files=[a,b]", "trainer.seed=9",
                       "trainer.experiment_name=e"])
    tree = cfg.to_dict()
    assert PPOConfig.from_dict(tree) == cfg
    assert yaml.safe_load(cfg.to_yaml()) == tree  # what a checkpoint's config.yaml holds
    assert PPOConfig.from_dict({"trainer": {"seed": 4}}).trainer.seed == 4  # keys it lacks keep their defaults
    with pytest.raises(ConfigError, match="data.train_batch_size \\(1000\\)"):
        PPOConfig.from_dict({"data": {"train_batch_size": 1000}})
    with pytest.raises(ConfigError, match="unknown config key trainer.sed"):
        PPOConfig.from_dict({"trainer": {"sed": 4}})


def test_config_file_then_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 64\n  max_prompt_length: 128\ntrainer:\n  seed: 7\n")
    cfg = load_config(["data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.n_gpus_per_node=1"],
                      config_file=path)
    assert cfg.data.train_batch_size == 32  # the command line wins
    assert cfg.data.max_prompt_length == 128
    assert cfg.trainer.seed == 7


def test_reward_kwargs_take_the_keys_the_user_names(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("custom_reward_function:\n  reward_kwargs:\n    scale: 2\n    modes: [strict, flexible]\n")
    cfg = load_config(["+custom_reward_function.reward_kwargs.bonus=0.5", "custom_reward_function.reward_kwargs.scale=3",
                       "trainer.n_gpus_per_node=1"], config_file=path, validate=False)
    assert cfg.custom_reward_function.reward_kwargs == {"scale": 3, "modes": ["strict", "flexible"], "bonus": 0.5}
    assert load_config(["custom_reward_function.reward_kwargs={a:1}", "~custom_reward_function.reward_kwargs"],
                       validate=False).custom_reward_function.reward_kwargs == {}
    assert load_config(["+data.apply_chat_template_kwargs.enable_thinking=false"], validate=False) \
        .data.apply_chat_template_kwargs == {"enable_thinking": False}
    # only those mappings are open: a key beside one is still unknown
    assert "unknown config key custom_reward_function.reward_kwarg.scale" in _errors(
        "+custom_reward_function.reward_kwarg.scale=2")


def test_chat_template_kwargs_naming_an_argument_of_apply_chat_template_are_refused():
    """The mapping reaches apply_chat_template beside the renderer's own arguments: max_length and truncation there cut
    every prompt to so many tokens (its generation prompt gone) whatever data.truncation said, without a word, and
    add_generation_prompt, given twice, failed on the first row as if the row or the template were at fault."""
    cut = "over-long prompts are cut as data.max_prompt_length and data.truncation say; remove it"
    assert _errors("+data.apply_chat_template_kwargs.enable_thinking=false", "+data.apply_chat_template_kwargs.max_length=5",
                   "+data.apply_chat_template_kwargs.truncation=true") == (
        "data.apply_chat_template_kwargs.max_length is an argument of apply_chat_template, not a variable of the chat "
        f"template, and is not taken: {cut}\n"
        "data.apply_chat_template_kwargs.truncation is an argument of apply_chat_template, not a variable of the chat "
        f"template, and is not taken: {cut}")
    # the reward model's mappings follow data's (the problem said once, above); one set apart is named by its own key
    assert _errors("reward_model.train.apply_chat_template_kwargs={add_generation_prompt: false}") == (
        "reward_model.train.apply_chat_template_kwargs.add_generation_prompt is an argument of apply_chat_template, not "
        "a variable of the chat template, and is not taken: every prompt ends in the template's generation prompt; "
        "remove it")
    # the template's own variables are taken
    cfg = load_config(["+data.apply_chat_template_kwargs.enable_thinking=false",
                       "+data.apply_chat_template_kwargs.tools=[]"], notice=lambda _: None)
    assert cfg.reward_model.model.input_chat_template_kwargs == {"enable_thinking": False, "tools": []}


def test_tilde_removes_an_entry_of_a_mapping_whose_keys_the_user_names(tmp_path):
    """``~`` on such an entry removes it, as Hydra's does: it left the key there holding None (which Ray then gave
    every worker as the string "None")."""
    path = tmp_path / "run.yaml"
    path.write_text("ray_kwargs:\n  ray_init:\n    runtime_env:\n      env_vars:\n        CUDA_LAUNCH_BLOCKING: '1'\n"
                    "        HF_HOME: /cache\ncustom_reward_function:\n  reward_kwargs:\n    scale: 2\n    bonus: 0.5\n")
    for spelling in ("ray_kwargs.ray_init.runtime_env", "trainer.ray_runtime_env"):  # verl's key and this one
        cfg = load_config([f"~{spelling}.env_vars.CUDA_LAUNCH_BLOCKING"], config_file=path, validate=False)
        assert cfg.trainer.ray_runtime_env == {"env_vars": {"HF_HOME": "/cache"}}
    cfg = load_config(["~custom_reward_function.reward_kwargs.scale"], config_file=path, validate=False)
    assert cfg.custom_reward_function.reward_kwargs == {"bonus": 0.5}
    # an entry that is not there: said, with what is (a misspelt name would otherwise remove nothing, silently)
    message = str(_config_error(["~trainer.ray_runtime_env.env_vars.HF_HOM"], path))
    assert "~trainer.ray_runtime_env.env_vars.HF_HOM: there is no HF_HOM in trainer.ray_runtime_env.env_vars to " \
           "remove (it holds CUDA_LAUNCH_BLOCKING, HF_HOME)" in message
    message = str(_config_error(["~trainer.ray_runtime_env.py_modules.0"], path))
    assert "there is no 0 to remove (trainer.ray_runtime_env.py_modules is not set)" in message


def test_tilde_drops_a_held_shard_size_or_interpolation_given_before_it(tmp_path):
    """``~key`` on a value held until every key is set (a shard-group size, an interpolation on a key without
    effect) drops it: it stayed held, and the run was refused over the very value deleted."""
    key = "actor_rollout_ref.ref.ulysses_sequence_parallel_size"
    notices = []
    cfg = load_config([f"{key}=${{oc.select:a.b,4}}", f"~{key}"], notice=notices.append)
    assert notices == []  # nothing left to judge: the default (no sequence parallelism) is what is done here
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 16  # the rest untouched
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  n_gpus_per_node: 4\nactor_rollout_ref:\n  actor:\n    fsdp_config:\n      fsdp_size: 2\n")
    assert "fsdp_size=2 is not supported" in str(_config_error([], path))  # the size deleted below, refused as given
    cfg = load_config(["~actor_rollout_ref.actor.fsdp_config.fsdp_size"], config_file=path, notice=notices.append)
    assert (cfg.trainer.n_gpus_per_node, notices) == (4, [])


def test_a_key_deleted_with_tilde_may_be_set_again_under_another_spelling():
    """``~`` forgets which spelling set the key (verl's alias, or newer verl's name), as it forgets its value: the
    key set again under another spelling was refused as two spellings disagreeing."""
    optim = "actor_rollout_ref.actor.optim"
    cfg = load_config([f"{optim}.warmup_style=constant", f"~{optim}.warmup_style", f"{optim}.lr_scheduler_type=cosine"],
                      notice=lambda _: None)
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    cfg = load_config(["reward.reward_model.model_path=/a", "~reward.reward_model.model_path",
                       "reward_model.model.path=/b"], notice=lambda _: None)
    assert cfg.reward_model.model.path == "/b"
    # without the ~, the two spellings still disagree on one command line
    assert "both set actor_rollout_ref.actor.optim.lr_scheduler_type" in _errors_or_none(
        f"{optim}.warmup_style=constant", f"{optim}.lr_scheduler_type=cosine")

def _config_error(overrides: list[str], path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, config_file=path, validate=False)
    return info.value


def test_verls_deprecated_keys_and_a_single_logger(tmp_path):
    notices = []
    path = tmp_path / "verl_generated.yaml"  # verl's generated config holds the deprecated sizes as null
    path.write_text("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size: null\n    ppo_micro_batch_size_per_gpu: 2\n"
                    "critic:\n  ppo_micro_batch_size: null\n")
    cfg = load_config(["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size=12",
                       "critic.optim.warmup_style=cosine", "trainer.logger=console"], config_file=path,
                      notice=notices.append, validate=False)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2  # null sets nothing
    assert cfg.critic.ppo_micro_batch_size_per_gpu == PPOConfig().critic.ppo_micro_batch_size_per_gpu
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 6  # 12 over 2 workers
    assert cfg.critic.optim.lr_scheduler_type == "cosine" and cfg.trainer.logger == ["console"]
    assert any("log_prob_micro_batch_size is deprecated" in n and "_per_gpu=6" in n for n in notices)
    assert any("critic.optim.warmup_style is an alias" in n for n in notices)
    moved = load_config(["critic.model.fsdp_config.param_offload=true"], notice=notices.append, validate=False)
    assert moved.critic.fsdp_config.param_offload is True  # verl's place for the critic's sharding keys
    message = _errors("trainer.n_gpus_per_node=2", "critic.ppo_micro_batch_size=3")
    assert "critic.ppo_micro_batch_size=3 (deprecated, over all 2 workers) must be a positive multiple" in message
    assert load_config(["actor_rollout_ref.actor.ppo_micro_batch_size=8", "~actor_rollout_ref.actor.ppo_micro_batch_size"],
                       validate=False).actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    # both forms of one size: verl refuses it, and so does this loader
    assert "ppo_micro_batch_size and actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu are both set" in _errors(
        "actor_rollout_ref.actor.ppo_micro_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    # ... whatever the per-worker value, its default (4) included, and wherever it was set
    assert "both set" in _errors("actor_rollout_ref.actor.ppo_micro_batch_size=16",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    both = tmp_path / "both.yaml"
    both.write_text("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 4\n")
    with pytest.raises(ConfigError, match="both set"):
        load_config(["actor_rollout_ref.actor.ppo_micro_batch_size=16"], config_file=both, validate=False)
    # set and then deleted: not given
    assert load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "~actor_rollout_ref.actor."
                        "ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_micro_batch_size=8"],
                       validate=False, notice=notices.append).actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 1
    # (8 over the default 8 workers a node)
    # verl's generated config: a deprecated alias at null sets nothing; an interpolation where a number is expected
    loaded = load_config(["actor_rollout_ref.actor.optim.warmup_style=null", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                          "actor_rollout_ref.ref.ulysses_sequence_parallel_size=${oc.select:a.b,1}"], validate=False)
    assert loaded.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    # an interpolation is judged by what it resolves to
    assert "ulysses_sequence_parallel_size=4 is not supported" in _errors(
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=${oc.select:nothing.here,4}")
    # the DAPO recipe's response budget of the length penalty must be the data's
    assert "max_resp_len=100 differs from data.max_response_length (512)" in _errors(
        "+reward_model.reward_kwargs.max_resp_len=100")
    assert load_config(["+reward_model.reward_kwargs.max_resp_len=512"], validate=False).data.max_response_length == 512
    assert not _errors_or_none("+reward_model.reward_kwargs.max_resp_len=${data.max_response_length}")  # the recipe's
    # a per-worker size left null (verl's generated config) beside the deprecated one: the deprecated one sets it
    assert load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "trainer.n_gpus_per_node=2",
                        "actor_rollout_ref.actor.ppo_micro_batch_size=8"], validate=False) \
        .actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    # ~alias: the key it stands for back to its default, and what it set besides
    assert load_config(["actor_rollout_ref.actor.optim.warmup_style=cosine", "~actor_rollout_ref.actor.optim.warmup_style"],
                       validate=False).actor_rollout_ref.actor.optim.lr_scheduler_type == "constant"
    reset = load_config(["algorithm.kl_ctrl_target=0.5", "~algorithm.kl_ctrl_target"], validate=False).algorithm.kl_ctrl
    assert (reset.type, reset.target_kl) == ("fixed", PPOConfig().algorithm.kl_ctrl.target_kl)


# keys of verl's generated trainer config (verl/trainer/config/_generated_ppo_trainer.yaml) with its default values,
# for machinery this trainer does not have or keys that repeat another's value: a verl user's full config file holds
# them, so each must be taken (with a notice where it says something), never refused as unknown
VERL_DEFAULTS_WITHOUT_COUNTERPART = """
actor_rollout_ref.actor._target_=verl.workers.config.FSDPActorConfig
actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.0002 actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.0002
actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.1 actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]
actor_rollout_ref.actor.checkpoint.async_save=false actor_rollout_ref.actor.optim.total_training_steps=-1
actor_rollout_ref.actor.use_fused_kernels=false actor_rollout_ref.actor.profiler.enable=false
actor_rollout_ref.actor.profiler.ranks=[] actor_rollout_ref.actor.profiler.tool_config.torch.step_start=0
actor_rollout_ref.actor.entropy_from_logits_with_chunking=false
actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0 actor_rollout_ref.actor.fsdp_config.offload_policy=false
actor_rollout_ref.actor.fsdp_config.forward_prefetch=false actor_rollout_ref.actor.fsdp_config.model_dtype=fp32
actor_rollout_ref.actor.use_remove_padding=false actor_rollout_ref.actor.tis_imp_ratio_cap=-1
actor_rollout_ref.ref.strategy=fsdp actor_rollout_ref.ref.use_torch_compile=true actor_rollout_ref.ref.entropy_checkpointing=false
actor_rollout_ref.rollout.prompt_length=512 actor_rollout_ref.rollout.response_length=512
actor_rollout_ref.rollout.max_model_len=null actor_rollout_ref.rollout.max_num_seqs=1024
actor_rollout_ref.rollout.cudagraph_capture_sizes=null actor_rollout_ref.rollout.disable_log_stats=true
actor_rollout_ref.rollout.over_sample_rate=0 actor_rollout_ref.rollout.multi_stage_wake_up=false
actor_rollout_ref.rollout.multi_turn.enable=false actor_rollout_ref.rollout.multi_turn.format=hermes
actor_rollout_ref.rollout.agent.num_workers=8 actor_rollout_ref.rollout.update_weights_bucket_megabytes=512
actor_rollout_ref.rollout.trace.backend=null actor_rollout_ref.rollout.trace.token2text=false
actor_rollout_ref.rollout.skip_rollout=false actor_rollout_ref.rollout.skip_dump_dir=/tmp/rollout_dump
actor_rollout_ref.model.custom_chat_template=null
actor_rollout_ref.model.enable_activation_offload=false actor_rollout_ref.model.exclude_modules=null
actor_rollout_ref.model.lora_adapter_path=null
data.use_shm=false data.return_raw_input_ids=false data.return_full_prompt=false data.dataloader_num_workers=8
data.validation_shuffle=false data.filter_overlong_prompts_workers=1 data.image_key=images data.video_key=videos
data.trust_remote_code=false data.custom_cls.path=null data.return_multi_modal_inputs=true data.sampler.class_path=null
data.datagen.name=null
critic.rollout_n=1 critic.enable=true critic.optim.min_lr_ratio=null critic.model.external_lib=null critic.model.use_shm=false
critic.model.enable_activation_offload=false critic.model.fsdp_config.offload_policy=false
critic.forward_max_token_len_per_gpu=32768 critic.forward_micro_batch_size_per_gpu=null critic.checkpoint.save_contents=[model,optimizer,extra]
critic.profiler.enable=false
reward_model.strategy=fsdp reward_model.model.use_shm=false reward_model.model.use_fused_kernels=false
reward_model.model.fsdp_config.fsdp_size=-1 reward_model.model.fsdp_config.forward_prefetch=false
reward_model.launch_reward_fn_async=false reward_model.sandbox_fusion.url=null reward_model.sandbox_fusion.max_concurrent=64
algorithm.use_pf_ppo=false algorithm.pf_ppo.reweight_method=pow algorithm.pf_ppo.weight_pow=2.0
trainer.rollout_data_dir=null trainer.validation_data_dir=null trainer.esi_redundant_time=0
trainer.ray_wait_register_center_timeout=300
algorithm.rollout_correction.bypass_mode=false algorithm.rollout_correction.loss_type=ppo_clip
algorithm.rollout_correction.rollout_is_batch_normalize=false algorithm.rollout_correction.rollout_rs_threshold_lower=null
algorithm.rollout_correction.rollout_token_veto_threshold=null
ray_init.num_cpus=null actor_rollout_ref.actor.optim.min_lr_ratio=null
global_profiler.tool=null global_profiler.steps=null global_profiler.save_path=outputs/profile
global_profiler.global_tool_config.nsys.worker_nsight_options.kill=none
ray_kwargs.ray_init.num_cpus=null ray_kwargs.timeline_json_file=null
""".split()


def test_verl_generated_config_keys_are_all_taken():
    notices = []
    cfg = load_config(VERL_DEFAULTS_WITHOUT_COUNTERPART, notice=notices.append, validate=False)
    assert cfg == load_config([], notice=lambda _: None, validate=False)  # and none changes a setting
    assert "notice: actor_rollout_ref.rollout.response_length=512 is taken: it repeats data.max_response_length, " \
        "which the rollout reads here" in notices
    assert "notice: critic.enable=True is taken: algorithm.adv_estimator=gae trains critic" in notices
    assert any(n.startswith("notice: actor_rollout_ref.rollout.max_num_seqs=1024 has no effect: not passed to vLLM")
               for n in notices)


def test_verls_collective_timeout_is_a_setting_here():
    assert load_config(["actor_rollout_ref.nccl_timeout=600"]).actor_rollout_ref.nccl_timeout == 600
    assert load_config([]).actor_rollout_ref.nccl_timeout == 1800  # CPU steps are slow: longer than verl's 600
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.nccl_timeout=0 must be > 0"):
        load_config(["actor_rollout_ref.nccl_timeout=0"])


def test_a_config_file_in_the_shape_of_verls_generated_one_loads(tmp_path):
    """verl's file form: each section names its class (_target_), keys interpolate their neighbours (${.key}),
    the reference's model is null and the rollout engine is left for the user (???)."""
    path = tmp_path / "verl.yaml"
    path.write_text("""
actor_rollout_ref:
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    checkpoint: {_target_: verl.trainer.config.CheckpointConfig, save_contents: [model, optimizer, extra],
                 load_contents: '${.save_contents}', async_save: false}
    optim: {_target_: verl.workers.config.FSDPOptimizerConfig, lr: 2.0e-06, total_training_steps: -1}
    fsdp_config: {wrap_policy: {min_num_params: 0}, fsdp_size: -1, offload_policy: false}
  ref: {model: null, strategy: '${actor_rollout_ref.actor.strategy}'}
  rollout:
    name: ???
    prompt_length: ${oc.select:data.max_prompt_length,512}
    engine_kwargs: {vllm: {}}
critic:
  rollout_n: ${oc.select:actor_rollout_ref.rollout.n,1}
  optim: {min_lr_ratio: null}
reward_model: {micro_batch_size_per_gpu: null, launch_reward_fn_async: false}
global_profiler:
  global_tool_config: {nsys: {worker_nsight_options: {capture-range-end: null, kill: none}}}
""")
    message = "\n".join(pytest.raises(ConfigError, load_config, [], config_file=path, notice=lambda _: None).value.errors)
    assert message == "actor_rollout_ref.rollout.name must be set (the config holds ??? there)"
    cfg = load_config(["actor_rollout_ref.rollout.name=hf"], config_file=path, notice=lambda _: None, validate=False)
    assert cfg.actor_rollout_ref.actor.optim.lr == 2.0e-06 and cfg.critic.optim.min_lr_ratio == 0.0


def test_verls_rollout_correction_keys_beyond_this_trainers_are_refused_away_from_their_defaults():
    message = _errors("algorithm.rollout_correction.bypass_mode=true",
                      "algorithm.rollout_correction.rollout_is_batch_normalize=true",
                      "algorithm.rollout_correction.loss_type=reinforce",
                      "algorithm.rollout_correction.rollout_token_veto_threshold=1e-4")
    assert ("algorithm.rollout_correction.bypass_mode=True is not supported: the trainer recomputes the old "
            "log-probs") in message
    assert ("algorithm.rollout_correction.rollout_is_batch_normalize=True is not supported: the importance weights "
            "are used as truncated, not renormalised") in message
    assert "algorithm.rollout_correction.loss_type='reinforce' is not supported: it is read in verl's bypass" in message
    assert "algorithm.rollout_correction.rollout_token_veto_threshold=0.0001 is not supported" in message


def test_verl_keys_asking_for_what_is_not_here_are_refused_with_the_reason():
    message = _errors(
        "actor_rollout_ref.rollout.multi_turn.enable=true", "critic.profiler.enable=true",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model]", "trainer.rollout_data_dir=/tmp/rollouts",
        "actor_rollout_ref.rollout.response_length=1024", "critic.enable=true", "algorithm.adv_estimator=grpo",
        "data.custom_cls.path=my_dataset.py", "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
        "actor_rollout_ref.model.lora_adapter_path=/sft/adapter")
    assert "actor_rollout_ref.rollout.multi_turn.enable=True is not supported: multi-turn rollouts with tools" in message
    assert "critic.profiler.enable=True is not supported: trainer.profile_steps records torch.profiler traces" in message
    assert "actor_rollout_ref.actor.checkpoint.save_contents=['model'] is not supported" in message
    assert "trainer.rollout_data_dir='/tmp/rollouts' is not supported: rollouts are not written out here" in message
    assert ("actor_rollout_ref.rollout.response_length=1024 differs from data.max_response_length (512), which the "
            "rollout reads here") in message
    assert "critic.enable=True is not supported: the critic is trained where the advantage estimator needs it " \
        "(algorithm.adv_estimator=grpo does not)" in message
    # named by the format the trainer reads: a JSON Lines file is refused there
    assert ("data.custom_cls.path='my_dataset.py' is not supported: prompts are read from parquet files in verl's "
            "format (JSON Lines are refused: write them as parquet)") in message
    assert "tis_imp_ratio_cap=2.0 is not supported: truncated importance sampling is " \
        "algorithm.rollout_correction.rollout_is=token" in message
    assert "actor_rollout_ref.model.lora_adapter_path='/sft/adapter' is not supported: LoRA adapters start fresh " \
        "here (B = 0): to start from a trained adapter, merge it into its base model" in message  # (not lora_alpha?)
    assert "actor_rollout_ref.rollout.name must be set (the config holds ??? there)" in _errors(
        "actor_rollout_ref.rollout.name=???")
    # verl's algorithm names this trainer lacks are named as such, never matched to a near name of another algorithm
    message = _errors("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "trainer.logger=[swanlab]")
    assert "loss_mode='clip_cov' (verl's) is not implemented here: one of vanilla, gspo, cispo" in message
    assert "trainer.logger='swanlab' (verl's) is not implemented here" in message and "wandb?" not in message
    # verl's prime manager scores as naive does
    notices = []
    assert load_config(["reward_model.reward_manager=prime"], notice=notices.append).reward_model.reward_manager \
        == "naive"
    assert any("reward_manager='prime' is taken as 'naive'" in n for n in notices)


def test_sections_without_counterpart_hold_no_key_of_this_trainer():
    from rlhf_core.config import WITHOUT_EFFECT, WITHOUT_EFFECT_BELOW, _known_keys
    known = _known_keys()
    assert not [k for k in known for section in WITHOUT_EFFECT_BELOW if k.startswith(section)]
    assert not [k for k in WITHOUT_EFFECT if k in known]


def test_verl_keys_without_a_counterpart_are_taken_when_harmless():
    notices = []
    cfg = load_config(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=1", "trainer.use_legacy_worker_impl=auto",
                       "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1", "critic.model.fsdp_config.grad_offload=false",
                       "actor_rollout_ref.model.use_rmpad=true", "critic.optim.clip_grad=0.5",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                       "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64", "+reward_model.reward_kwargs.max_resp_len=512",
                       "actor_rollout_ref.rollout.enable_chunked_prefill=false"], notice=notices.append, validate=False)
    assert cfg.actor_rollout_ref.model.use_remove_padding is True and cfg.critic.grad_clip == 0.5
    assert (cfg.reward_model.overlong_buffer.enable, cfg.reward_model.overlong_buffer.len) == (True, 64)
    assert cfg.actor_rollout_ref.rollout.enable_chunked_prefill is False
    assert any("ulysses_sequence_parallel_size=1 has no effect: there is no sequence parallelism here" in n
               for n in notices)
    assert any("use_legacy_worker_impl='auto' has no effect" in n for n in notices)
    # a value that would mean something the trainer does not do is refused, saying what it does instead
    message = _errors("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.model.fsdp_config.fsdp_size=4")
    assert "ulysses_sequence_parallel_size=2 is not supported: there is no sequence parallelism here" in message
    assert "critic.model.fsdp_config.fsdp_size=4 is not supported: FSDP2 shards over all the 8 workers" in message
    # verl's mesh is one shard group over all workers for a size below 0 or of at least the workers (its
    # 8-GPU examples write fsdp_size=8); a smaller size is hybrid sharding, which is refused
    notices = []
    load_config(["trainer.n_gpus_per_node=4", "trainer.nnodes=2", "critic.model.fsdp_config.fsdp_size=8",
                 "actor_rollout_ref.ref.fsdp_config.fsdp_size=16"], notice=notices.append, validate=False)
    assert "notice: critic.model.fsdp_config.fsdp_size=8 has no effect: FSDP2 shards over all the 8 workers" in notices
    assert any(n.startswith("notice: actor_rollout_ref.ref.fsdp_config.fsdp_size=16 has no effect") for n in notices)
    assert "actor_rollout_ref.actor.fsdp_config.fsdp_size=4 is not supported" in _errors(
        "trainer.n_gpus_per_node=4", "trainer.nnodes=2", "actor_rollout_ref.actor.fsdp_config.fsdp_size=4")
    assert "fsdp_size=0 is not supported" in _errors("actor_rollout_ref.actor.fsdp_config.fsdp_size=0")
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size is not supported: Megatron is not a backend" \
        in _errors("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    # gen_batch_size is dynamic sampling's; elsewhere it can only be train_batch_size
    assert "data.gen_batch_size=4 sets the prompts of each generation round" in _errors("data.gen_batch_size=4")


def test_aliases_map_to_canonical_keys_with_a_notice():
    notices = []
    cfg = load_config(
        [
            "actor_rollout_ref.actor.optim.max_grad_norm=0.5",
            "critic.optim.max_grad_norm=0.3",
            "trainer.checkpoint.every_n_steps=25",
            "algorithm.kl_ctrl_target=0.02",
            "algorithm.use_kl_in_reward=true",  # (without it, the controller has no effect: a notice of its own)
        ],
        notice=notices.append,
    )
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5
    assert cfg.critic.grad_clip == 0.3
    assert cfg.trainer.save_freq == 25
    assert cfg.algorithm.kl_ctrl.target_kl == 0.02
    assert cfg.algorithm.kl_ctrl.type == "adaptive"
    assert len(notices) == 4
    assert "actor_rollout_ref.actor.grad_clip" in notices[0]
    assert "trainer.save_freq" in notices[2]
    # the alias sets the controller's type besides, and says so (its advice alone would leave it fixed)
    assert notices[3] == ("notice: algorithm.kl_ctrl_target is an alias; use algorithm.kl_ctrl.target_kl and "
                          "algorithm.kl_ctrl.type=adaptive")


@pytest.mark.parametrize(("model", "other"), [("actor_rollout_ref.model", "critic.model"),
                                              ("critic.model", "actor_rollout_ref.model")])
def test_verls_use_rmpad_packs_the_sequences_of_its_own_model_alone(model, other):
    cfg = load_config([f"{model}.use_rmpad=true"], notice=lambda _: None)
    assert attribute(cfg, f"{model}.use_remove_padding") is True
    assert attribute(cfg, f"{other}.use_remove_padding") is False


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml does not exist"):
        load_config(config_file=tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml must hold a mapping"):
        load_config(config_file=tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("trainer: [\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(config_file=tmp_path / "bad.yaml")
    (tmp_path / "typo.yaml").write_text("trainer:\n  sav_freq: 3\n  seed: x\n")
    with pytest.raises(ConfigError) as info:  # every problem in the file, not only the first
        load_config(config_file=tmp_path / "typo.yaml")
    typo = tmp_path / "typo.yaml"
    assert info.value.errors == [f"unknown config key trainer.sav_freq; did you mean trainer.save_freq? (in {typo})",
                                 f"trainer.seed='x': Value 'x' of type 'str' could not be converted to Integer (in "
                                 f"{typo})"]


def test_alias_inside_a_yaml_file(tmp_path):
    path = tmp_path / "guide.yaml"
    path.write_text("trainer:\n  checkpoint:\n    every_n_steps: 10\n")
    assert load_config(config_file=path, notice=lambda _: None).trainer.save_freq == 10


def test_verls_checkpoint_keys_are_taken_as_verl_means_them(tmp_path):
    notices = []
    cfg = load_config(["trainer.remove_previous_ckpt_in_save=true", "trainer.default_hdfs_dir=null",
                       "trainer.del_local_ckpt_after_load=false"], notice=notices.append)
    # verl's deprecated switch: one actor and one critic checkpoint kept, with a notice saying so
    assert (cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep) == (1, 1)
    assert notices == ["notice: trainer.remove_previous_ckpt_in_save is deprecated (as in verl); use "
                       "trainer.max_actor_ckpt_to_keep=1 and trainer.max_critic_ckpt_to_keep=1"]
    path = tmp_path / "verl.yaml"  # as verl's own yaml spells them, false changes nothing
    path.write_text("trainer:\n  remove_previous_ckpt_in_save: false\n  max_actor_ckpt_to_keep: 0\n"
                    "  default_hdfs_dir: null\n")
    cfg = load_config(config_file=path, notice=notices.append)
    assert (cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep) == (0, None)  # both: keep all
    assert len(notices) == 1
    message = _errors("trainer.default_hdfs_dir=hdfs://ckpt", "trainer.del_local_ckpt_after_load=true",
                      "trainer.max_critic_ckpt_to_keep=-1")
    assert "trainer.default_hdfs_dir='hdfs://ckpt': there is no HDFS copy here" in message
    assert "trainer.del_local_ckpt_after_load=true would delete the only copy of the checkpoint" in message
    assert "trainer.max_critic_ckpt_to_keep=-1 must be >= 0 (0 or null: keep all)" in message


def test_a_later_false_or_tilde_undoes_verls_remove_previous_ckpt_in_save(tmp_path):
    """verl's switch is read at its last value (verl keeps one checkpoint where it is true at the end, else
    max_*_ckpt_to_keep's own): a true from a file or earlier on the command line kept one checkpoint whatever
    came after it."""
    switch, notices = "trainer.remove_previous_ckpt_in_save", []

    def kept(cfg):  # the actor's and the critic's checkpoints kept (null: all)
        return cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep

    path = tmp_path / "verl.yaml"
    path.write_text("trainer:\n  remove_previous_ckpt_in_save: true\n")
    for overrides in ([f"{switch}=false"], [f"~{switch}"]):
        assert kept(load_config(overrides, config_file=path, notice=notices.append)) == (None, None)  # keep all
    assert kept(load_config([f"{switch}=true", f"{switch}=false"], notice=notices.append)) == (None, None)
    assert kept(load_config([f"{switch}=true", f"~{switch}", "trainer.max_actor_ckpt_to_keep=3"],
                            notice=notices.append)) == (3, None)
    assert notices == []  # off at the end: not said to be in use
    assert kept(load_config([f"{switch}=false", f"{switch}=true"], notice=notices.append)) == (1, 1)
    # on at the end, over a count given in another place (the file), as verl's switch decides; in one place, refused
    path.write_text("trainer:\n  max_actor_ckpt_to_keep: 3\n")
    notices.clear()
    assert kept(load_config([f"{switch}=true"], config_file=path, notice=notices.append)) == (1, 1)
    assert notices[1] == (f"notice: trainer.max_actor_ckpt_to_keep=3 is not read: {switch}=true sets "
                          f"trainer.max_actor_ckpt_to_keep=1 (as in verl); set {switch}=false to keep 3")
    assert "both set trainer.max_actor_ckpt_to_keep" in _errors_or_none(f"{switch}=true",
                                                                        "trainer.max_actor_ckpt_to_keep=3")

def test_unknown_key_suggests_the_closest():
    message = _errors("actor_rollout_ref.actor.clip_ratoi=0.1")
    assert "unknown config key actor_rollout_ref.actor.clip_ratoi" in message
    assert "did you mean actor_rollout_ref.actor.clip_ratio?" in message
    message = _errors("trainer.sav_freq=3")
    assert "did you mean trainer.save_freq?" in message


def test_train_batch_not_divisible_by_mini_batch_names_both_keys():
    message = _errors("data.train_batch_size=1000", "actor_rollout_ref.actor.ppo_mini_batch_size=64")
    assert "data.train_batch_size (1000)" in message
    assert "actor_rollout_ref.actor.ppo_mini_batch_size (64)" in message
    assert "critic.ppo_mini_batch_size" not in message  # the critic inherits; one error, not two


def test_mini_batch_times_n_not_divisible_by_micro_times_world():
    message = _errors(
        "data.train_batch_size=12",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.n_gpus_per_node=1",
    )
    assert "6 * 1 = 6 sequences" in message and "(4 * 1)" in message
    # world size counts: 8 * 1 sequences over 2 workers of micro-batch 4 is not whole
    message = _errors(
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=1",
        "trainer.n_gpus_per_node=2",
    )
    assert "(8 * 2)" in message
    load_config(["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.n_gpus_per_node=2"])


def test_the_world_size_counts_the_workers_of_every_node():
    """4 workers a node on 2 nodes are 8 workers: a mini-batch of 8 sequences is one sequence each, half of a
    micro-batch of 2."""
    sizes = ["trainer.n_gpus_per_node=4", "trainer.nnodes=2", "data.train_batch_size=8",
             "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=1",
             "critic.ppo_micro_batch_size_per_gpu=1"]
    assert load_config(sizes[:2], notice=lambda _: None, validate=False).world_size == 8
    message = _errors(*sizes, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    assert "(8 * 1 = 8 sequences) must be divisible by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu * world " \
           "size (2 * 8)" in message
    load_config([*sizes, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"], notice=lambda _: None)


def test_the_reward_models_training_batch_is_shared_out_over_every_worker():
    """8 pairs over 2 workers are 4 each, half of a micro-batch of 8; 16 pairs are one micro-batch each."""
    sizes = ["trainer.n_gpus_per_node=2", "reward_model.train.micro_batch_size_per_gpu=8"]
    cfg = load_config([*sizes, "reward_model.train.train_batch_size=8"], notice=lambda _: None)
    assert reward_training_batch_problems(cfg) == [
        "reward_model.train.train_batch_size (8) must be divisible by reward_model.train.micro_batch_size_per_gpu "
        "* world size (8 * 2) so each worker gets whole micro-batches"]
    cfg = load_config([*sizes, "reward_model.train.train_batch_size=16"], notice=lambda _: None)
    assert reward_training_batch_problems(cfg) == []


def test_micro_batch_required_without_dynamic_bsz():
    message = _errors("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null")
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is required" in message
    cfg = load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                       "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz


def test_dynamic_bsz_token_budget_must_hold_one_sequence():
    message = _errors(
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
    )
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu (600)" in message
    assert "(1024)" in message
    # a budget of exactly 512 + 512 tokens holds the longest sequence; one token fewer does not
    assert "ppo_max_token_len_per_gpu (1023) must be >= max_prompt_length + max_response_length (1024)" in _errors(
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1023")
    load_config(["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024"],
                notice=lambda _: None)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("actor_rollout_ref.actor.clip_ratio=0", "actor_rollout_ref.actor.clip_ratio=0.0 must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio_low=-0.1", "clip_ratio_low=-0.1 must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio_high=0", "clip_ratio_high=0.0 must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio_c=1.0", "clip_ratio_c=1.0 must be > 1"),
        ("algorithm.lam=1.5", "algorithm.lam=1.5 must be in [0, 1]"),
        ("algorithm.gamma=-0.1", "algorithm.gamma=-0.1 must be in [0, 1]"),
        ("algorithm.gamma=1.01", "algorithm.gamma=1.01 must be in [0, 1]"),
        ("actor_rollout_ref.actor.optim.min_lr_ratio=-0.5",
         "actor_rollout_ref.actor.optim.min_lr_ratio=-0.5 must be in [0, 1]"),
        ("critic.optim.min_lr_ratio=2", "critic.optim.min_lr_ratio=2.0 must be in [0, 1]"),
        ("actor_rollout_ref.actor.optim.weight_decay=-0.1",
         "actor_rollout_ref.actor.optim.weight_decay=-0.1 must be >= 0"),
        ("reward_model.train.optim.min_lr_ratio=-1", "reward_model.train.optim.min_lr_ratio=-1.0 must be in [0, 1]"),
        ("actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.lr=0.0 must be > 0"),
        ("critic.optim.lr=-1e-5", "critic.optim.lr=-1e-05 must be > 0"),
        ("actor_rollout_ref.rollout.val_kwargs.n=0", "actor_rollout_ref.rollout.val_kwargs.n=0 must be > 0"),
        ("trainer.log_val_generations=-1", "trainer.log_val_generations=-1 must be >= 0"),
        ("trainer.val_only=true data.val_files=null", "trainer.val_only=true validates on data.val_files: set them"),
        ("reward_model.reward_manager=primo", "reward_model.reward_manager='primo' is not one of naive, dapo, batch"),
        ("reward_model.reward_manager=batch", "reward_model.reward_manager=batch calls custom_reward_function with "
                                              "whole batches: set custom_reward_function.path"),
        ("actor_rollout_ref.actor.kl_loss_type=low_var", "kl_loss_type='low_var' is not one of"),
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator='ppo' is not one of"),
        ("actor_rollout_ref.actor.loss_agg_mode=mean", "loss_agg_mode='mean' is not one of"),
        ("actor_rollout_ref.rollout.name=sglang", "rollout.name='sglang' (verl's) is not implemented here: one of hf, vllm"),
        ("trainer.logger=[console,neptune]", "trainer.logger='neptune' is not one of"),
        ("data.train_batch_size=abc", "data.train_batch_size='abc': Value 'abc' of type 'str' could not be converted"),
        ("data.train_files=5", "data.train_files=5 must be a string or a list of strings"),
        ("trainer.logger=neptune", "trainer.logger='neptune' is not one of"),  # one name is a list of it
        ("trainer.default_local_dir=out/${trainer.nope}", "trainer.default_local_dir: Interpolation key 'trainer.nope'"),
        ("algorithm.adv_estimator=ppo", "is not one of gae, grpo, rloo, reinforce_plus_plus"),
        ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type='pid' is not one of fixed, adaptive"),
        ("trainer.logger=[neptune]", "is not one of console, file, tensorboard, wandb, mlflow"),
        ("trainer.resume_mode=resume_path", "needs trainer.resume_from_path"),
        ("actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p=0.0 must be in (0, 1]"),
        ("actor_rollout_ref.rollout.val_kwargs.top_p=0", "rollout.val_kwargs.top_p=0.0 must be in (0, 1]"),
        ("actor_rollout_ref.rollout.val_kwargs.temperature=-1", "val_kwargs.temperature=-1.0 must be >= 0"),
        ("actor_rollout_ref.rollout.val_kwargs.top_k=-2", "val_kwargs.top_k=-2 must be >= 1, or -1 or 0 for off"),
        ("actor_rollout_ref.rollout.top_k=-3", "rollout.top_k=-3 must be >= 1, or -1 or 0 for off"),
    ],
)
def test_each_invalid_value_is_named(override, needle):
    assert needle in _errors(*override.split(" "))


#: the float keys where +inf is taken, for what clip_grad_norm_ does with an infinite max_norm: no clipping
INFINITY_MEANS_NO_CLIPPING = ("actor_rollout_ref.actor.grad_clip", "critic.grad_clip", "reward_model.train.grad_clip")

# keys no range check refused NaN or inf in, and keys whose range check refused them with a message of its own
NOT_FINITE = [
    "reward_model.train.margin", "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.optim.weight_decay", "critic.optim.lr", "algorithm.kl_ctrl.kl_coef",
    "critic.optim.num_cycles", "reward_model.train.optim.min_lr_ratio", "trainer.guard.max_kl",
    "actor_rollout_ref.actor.clip_ratio_low", "algorithm.lam", "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.actor.optim.lr", "reward_model.train.min_pair_accuracy",
]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
@pytest.mark.parametrize("key", NOT_FINITE)
def test_a_float_key_refuses_nan_and_infinities_in_one_message(key, value):
    """A NaN or an infinity would train on NaN (or stop on the guards, which blame data, dtype or learning rate):
    refused once, in the same words for every key, without the range check's message about the same value."""
    shown = {"1e400": "inf"}.get(value, value)  # (1e400 overflows to inf as the override is read)
    with pytest.raises(ConfigError) as info:
        load_config([f"{key}={value}"], notice=lambda _: None)
    assert info.value.errors == [f"{key}={shown} must be a finite number"]


@pytest.mark.parametrize("key", INFINITY_MEANS_NO_CLIPPING)
def test_grad_clip_takes_inf_for_no_clipping_and_never_nan(key):
    assert attribute(load_config([f"{key}=inf"], notice=lambda _: None), key) == float("inf")
    with pytest.raises(ConfigError) as info:
        load_config([f"{key}=nan"], notice=lambda _: None)
    assert info.value.errors == [f"{key}=nan must be a finite number or inf (no clipping)"]
    with pytest.raises(ConfigError) as info:
        load_config([f"{key}=-inf"], notice=lambda _: None)
    assert info.value.errors == [f"{key}=-inf must be > 0"]


def test_a_list_of_floats_refuses_nan_and_a_file_s_yaml_nan_and_inf_alike(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    entropy_coeff: .nan\ncritic:\n  optim:\n    betas: [0.9, .inf]\n")
    with pytest.raises(ConfigError) as info:
        load_config([], config_file=path, notice=lambda _: None)
    assert sorted(info.value.errors) == ["actor_rollout_ref.actor.entropy_coeff=nan must be a finite number",
                                         "critic.optim.betas=[0.9, inf] must be finite numbers"]


def test_every_float_key_of_the_tree_refuses_nan():
    """Each key whose default is a float, read from the dataclasses' defaults: none is left out of the check."""
    floats = [key for key, default, _ in _dataclass_tree(PPOConfig()) if isinstance(default, float)]
    assert len(floats) > 30 and "reward_model.train.margin" in floats
    for key in floats:
        with pytest.raises(ConfigError) as info:
            load_config([f"{key}=nan"], notice=lambda _: None)
        tail = " or inf (no clipping)" if key in INFINITY_MEANS_NO_CLIPPING else ""
        assert info.value.errors == [f"{key}=nan must be a finite number{tail}"], key


def test_unknown_name_suggests_a_close_valid_one():
    assert "did you mean low_var_kl?" in _errors("actor_rollout_ref.actor.kl_loss_type=low_var_kll")


def test_a_discount_of_0_is_taken_as_lam_0_is():
    """gamma=0 was refused, though nothing divides by it: each token's advantage is its own reward against its
    value, as verl computes it."""
    assert load_config(["algorithm.gamma=0"]).algorithm.gamma == 0.0


def test_all_errors_are_reported_together():
    message = _errors("algorithm.lam=2", "algorithm.gamma=-1", "actor_rollout_ref.actor.clip_ratio_c=0.5")
    assert "algorithm.lam" in message and "algorithm.gamma" in message and "clip_ratio_c" in message


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_core.config", *args], capture_output=True, text=True)


def test_cli_rejects_inconsistent_batches_with_exit_2():
    result = _cli("data.train_batch_size=1000", "actor_rollout_ref.actor.ppo_mini_batch_size=64")
    assert result.returncode == 2
    assert "data.train_batch_size" in result.stderr and "ppo_mini_batch_size" in result.stderr
    assert result.stdout == ""


def test_cli_reports_every_input_error_with_exit_2_and_no_traceback():
    result = _cli("trainer.sav_freq=3", "data.train_files=~/x", "data.train_batch_size=abc")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("invalid config:\n")
    assert "unknown config key trainer.sav_freq; did you mean trainer.save_freq?" in result.stderr
    assert "quote a value" in result.stderr and "data.train_batch_size='abc'" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_takes_overrides_on_both_sides_of_the_config_file_and_refuses_what_it_cannot_read(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  seed: 3\n")
    result = _cli("data.train_batch_size=512", "--config", str(path), "trainer.total_epochs=2")
    assert result.returncode == 0, result.stderr
    tree = yaml.safe_load(result.stdout)
    assert (tree["data"]["train_batch_size"], tree["trainer"]["seed"], tree["trainer"]["total_epochs"]) == (512, 3, 2)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("# caf\u00e9\ntrainer:\n  seed: 3\n".encode("latin-1"))
    result = _cli("--config", str(latin))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"config file {latin} is not UTF-8 text (byte 5: invalid continuation byte)" in result.stderr


def test_a_list_for_a_mapping_or_a_mapping_for_a_list_is_said_in_one_line(tmp_path):
    """OmegaConf refuses these with errors of its own kinds, which left a traceback and exit 1."""
    key = "custom_reward_function.reward_kwargs"
    assert _errors_or_none(f"{key}=[1]") == (f"{key}=[1]: {key} takes a mapping, not a list; write name: value "
                                             f"entries, e.g. {key}={{a: 1}}")
    assert _errors_or_none(f"{key}={{1:2}}") == (f"{key}={{1: 2}}: {key} takes names as its keys, not 1: name each "
                                                 f"entry, e.g. {key}={{a: 1}}")
    assert _errors_or_none("trainer.logger={console:1}") == (
        "trainer.logger={'console': 1}: trainer.logger takes a list, not a mapping; write a list, e.g. "
        "trainer.logger=[a,b]")
    # a section given whole: the entry at fault named, as a file's would be
    assert _errors_or_none("trainer={seed:3,logger:{console:1}}") == (
        "trainer.logger={'console': 1}: trainer.logger takes a list, not a mapping; write a list, e.g. "
        "trainer.logger=[a,b]")
    assert _errors_or_none("trainer={sav_freq:3}") == "unknown config key trainer.sav_freq; did you mean trainer.save_freq?"
    path = tmp_path / "run.yaml"
    path.write_text("custom_reward_function:\n  reward_kwargs: [1, 2]\n")
    assert _config_error([], path).errors == [f"{key}=[1, 2]: {key} takes a mapping, not a list; write name: value "
                                              f"entries, e.g. {key}={{a: 1}} (in {path})"]
    result = _cli(f"{key}=[1]")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{key} takes a mapping, not a list" in result.stderr


def test_a_config_file_under_the_home_folder_is_read_from_tilde(tmp_path, monkeypatch):
    """A shell expands ~ in ``--config ~/x.yaml`` but leaves ``--config=~/x.yaml`` as written."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run.yaml").write_text("trainer:\n  seed: 7\n")
    assert load_config(config_file="~/run.yaml").trainer.seed == 7
    result = _cli("--config=~/run.yaml")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["trainer"]["seed"] == 7

def test_a_null_validation_file_list_says_how_to_have_none():
    assert "data.val_files=None must be a string or a list of strings, e.g. data.val_files=[a,b]; for no " \
           "validation, data.val_files=[]" in _errors("data.val_files=null")
    assert load_config(["data.val_files=[]"], notice=lambda _: None).data.val_files == []


def test_the_hybrid_engine_cannot_be_turned_off():
    assert "actor_rollout_ref.hybrid_engine=false: the actor, its rollout and the reference always share" in \
        _errors("actor_rollout_ref.hybrid_engine=false")
    load_config(["actor_rollout_ref.hybrid_engine=true"], notice=lambda _: None)


def test_cli_alias_prints_grad_clip_and_a_notice():
    result = _cli("actor_rollout_ref.actor.optim.max_grad_norm=0.5")
    assert result.returncode == 0, result.stderr
    tree = yaml.safe_load(result.stdout)
    assert tree["actor_rollout_ref"]["actor"]["grad_clip"] == 0.5
    assert tree["critic"]["grad_clip"] == 1.0
    assert "alias" in result.stderr and "actor_rollout_ref.actor.grad_clip" in result.stderr


def test_rollout_correction_on_vllm_refuses_top_p_and_top_k():
    """vLLM's processed log-probs are renormalised over the tokens top-p / top-k keep: with logits [2, 1, .5, 0, -1]
    and top_p=0.8 the kept mass is 0.8957, so every ratio would read exp(ln 0.8957) = 0.896 with equal weights."""
    on = ["actor_rollout_ref.rollout.name=vllm", "algorithm.rollout_correction.rollout_is=token"]
    message = _errors(*on, "actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.top_k=20")
    assert "algorithm.rollout_correction with actor_rollout_ref.rollout.name=vllm and top_p=0.8 and top_k=20" in message
    load_config(on, notice=lambda _: None)  # whole vocabulary: the two log-probs are the same quantity
    load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.top_p=0.8"], notice=lambda _: None)


def test_vllms_tensor_parallel_size_must_divide_the_workers():
    vllm = ["trainer.device=cuda", "actor_rollout_ref.rollout.name=vllm"]  # checked on loading: no GPU is needed
    message = _errors(*vllm, "actor_rollout_ref.rollout.tensor_model_parallel_size=3")
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=3 must divide the world size (8 = " \
           "trainer.n_gpus_per_node * trainer.nnodes)" in message
    load_config([*vllm, "actor_rollout_ref.rollout.tensor_model_parallel_size=4"], notice=lambda _: None)


def test_a_critic_that_never_trains_is_refused():
    """critic.ppo_epochs=0 under GAE: the update loop runs no pass, so the value model would never learn."""
    assert "critic.ppo_epochs=0 must be" in _errors("algorithm.adv_estimator=gae", "critic.ppo_epochs=0")
    load_config(["algorithm.adv_estimator=grpo", "critic.ppo_epochs=0"], notice=lambda _: None)  # no critic: unread


@pytest.mark.parametrize(("override", "said", "fixed"), [
    # 1024 prompts: 96 does not divide it; the critic's mini-batches need a multiple of 4 * 8 = 32 prompts (one
    # response each), and of 1024's divisors 64 and 128 are as near to 96 as each other: the larger is taken
    ("critic.ppo_mini_batch_size=96", "data.train_batch_size (1024) must be divisible by critic.ppo_mini_batch_size "
                                      "(96): set ppo_mini_batch_size to a divisor, e.g. 128",
     "critic.ppo_mini_batch_size=128"),
    # the actor's 256 sequences, which the critic follows, over 8 workers are 32 each: whole micro-batches of 4
    # (the actor's) or 2, not of 3
    ("critic.ppo_micro_batch_size_per_gpu=3", "critic.ppo_mini_batch_size * rollout.n (256 * 1 = 256 sequences) must "
                                              "be divisible by critic.ppo_micro_batch_size_per_gpu * world size (3 * 8)",
     "critic.ppo_micro_batch_size_per_gpu=2"),
])
def test_the_critics_own_batch_sizes_are_checked(override, said, fixed):
    assert said in _errors("algorithm.adv_estimator=gae", override)
    load_config(["algorithm.adv_estimator=gae", fixed], notice=lambda _: None)


def test_two_spellings_of_one_key_with_different_values_are_refused(tmp_path):
    """verl's DAPO spelling and the key it stands for, disagreeing on one command line (or in one file): the one
    written last won without a word. Agreeing, or a later command line over the file, is taken."""
    conflict = _errors_or_none("reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=32",
                               "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=false")
    assert conflict == ("reward_model.reward_kwargs.overlong_buffer_cfg.enable=False and "
                        "reward_model.overlong_buffer.enable=True both set reward_model.overlong_buffer.enable "
                        "(verl's spellings of one key): keep one")
    assert _errors_or_none("reward_model.overlong_buffer.len=32", "+reward_model.reward_kwargs.overlong_buffer_cfg.len=32",
                           "trainer.seed=1", "trainer.seed=2") is None  # agreeing; one key given twice: the last
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    grad_clip: 1.0\n    optim:\n      max_grad_norm: 0.5\n")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.optim.max_grad_norm=0.5 and "
                                          r"actor_rollout_ref.actor.grad_clip=1.0 both set"):
        load_config([], config_file=path, notice=lambda _: None, validate=False)
    path.write_text("actor_rollout_ref:\n  actor:\n    grad_clip: 1.0\n")
    cfg = load_config(["actor_rollout_ref.actor.optim.max_grad_norm=0.25"], config_file=path, notice=lambda _: None,
                      validate=False)
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.25  # the command line over the file


def test_a_key_verl_replaced_names_its_replacement():
    assert _errors_or_none("actor_rollout_ref.actor.use_token_level_loss=true") == (
        "unknown config key actor_rollout_ref.actor.use_token_level_loss; use actor_rollout_ref.actor.loss_agg_mode="
        "token-mean (true) or seq-mean-token-mean (false), as verl replaced it")


@pytest.mark.parametrize("run_config", ["demo_cpu.yaml", "retrain_demo.yaml", "demo_rm_cpu.yaml"])
def test_a_pipeline_run_config_given_as_the_trainer_config_says_what_it_is(repo_root, run_config):
    """configs/ holds both kinds side by side: a run config read as trainer keys gave a dozen unknown keys with
    wrong guesses (model.tags: 'did you mean ...optim.betas?')."""
    path = repo_root / "configs" / run_config
    with pytest.raises(ConfigError) as info:
        load_config(config_file=path)
    [error] = info.value.errors
    assert error.startswith(f"config file {path} is a ZenML pipeline run config (its parameters name the trainer "
                            "config 'configs/ppo_demo_cpu.yaml'")
    assert "give the trainer config itself here" in error
    load_config(config_file=repo_root / "configs" / "ppo_demo_cpu.yaml")  # the trainer config loads


def test_a_config_error_pickles_whole():
    """A worker's ConfigError reaches the driver through pickle (Ray): its message is rebuilt from its errors,
    not from the message read as a list of characters."""
    import pickle

    from rlhf_core.training.reward_trainer import RewardTrainingError

    for error in (ConfigError(["a.b must be positive"]), RewardTrainingError(["no pairs"])):
        error.add_note("to go on: rerun with x=1")  # the advice a failure record keeps (rlhf_core.pipeline.failure)
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error) and again.errors == error.errors
        assert again.__notes__ == ["to go on: rerun with x=1"]


def test_verls_max_samples_and_image_and_databuffer_data_keys():
    notices = []
    cfg = load_config(["data.train_max_samples=2048", "data.val_max_samples=100", "data.image_patch_size=14",
                       "data.databuffer.enable=false", "data.databuffer.keep_filtered=false"], notice=notices.append)
    assert (cfg.data.train_max_samples, cfg.data.val_max_samples) == (2048, 100)
    assert (PPOConfig().data.train_max_samples, PPOConfig().data.val_max_samples) == (-1, -1)  # verl's: all rows
    assert any(n.startswith("notice: data.image_patch_size=14 has no effect") for n in notices)
    assert any(n.startswith("notice: data.databuffer.enable=False has no effect") for n in notices)
    assert any(n.startswith("notice: data.databuffer.keep_filtered=False has no effect") for n in notices)
    assert "data.databuffer.enable=True is not supported" in _errors("data.databuffer.enable=true")
    # fewer prompts kept than a batch draws cannot make one step: refused before any model loads
    sizes = ["data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.n_gpus_per_node=1"]
    message = _errors(*sizes, "data.train_max_samples=40")
    assert "data.train_max_samples (40) keeps fewer prompts than data.train_batch_size (64)" in message
    assert load_config([*sizes, "data.train_max_samples=64"], notice=lambda _: None).data.train_max_samples == 64


@pytest.mark.parametrize(("recipe_text", "key", "value", "notices_said"), [
    # the head of verl's recipe files: Hydra's search path, then verl's tree and the file's own keys over it
    ("hydra:\n  searchpath:\n    - file://verl/trainer/config\ndefaults:\n  - ppo_trainer\n  - _self_\n"
     "data:\n  train_batch_size: 64\n", "data.train_batch_size", 64,
     ["its defaults list (ppo_trainer, _self_) is not read", "hydra.* (Hydra's own settings) is not read"]),
    # Hydra's job_logging chosen in the defaults list is Hydra's setting, as the hydra: section is
    ("defaults:\n  - ppo_trainer\n  - _self_\n  - override hydra/job_logging: disabled\n"
     "actor_rollout_ref:\n  actor:\n    clip_ratio: 0.3\n", "actor_rollout_ref.actor.clip_ratio", 0.3,
     ["override hydra/job_logging: disabled (Hydra's own settings) is not read here",
      "its defaults list (ppo_trainer, _self_) is not read"]),
])
def test_a_defaults_list_naming_verls_ppo_trainer_and_hydras_settings_is_dropped_with_a_notice(
        tmp_path, recipe_text, key, value, notices_said):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text)
    notices = []
    cfg = load_config(config_file=recipe, notice=notices.append, validate=False)
    assert cfg.value(key) == value
    for said in notices_said:
        assert any(said in n for n in notices), said


def test_a_defaults_list_with_self_before_ppo_trainer_is_refused(tmp_path):
    # in Hydra, _self_ first lets verl's defaults override the file's keys: clip_ratio would stay 0.2, not 0.3
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("defaults:\n  - _self_\n  - ppo_trainer\nactor_rollout_ref:\n  actor:\n"
                          "    clip_ratio: 0.3\n")
    with pytest.raises(ConfigError) as info:
        load_config(config_file=experiment, notice=lambda _: None, validate=False)
    message = "\n".join(info.value.errors)
    assert f"config file {experiment}: its defaults list (_self_, ppo_trainer) puts _self_ before ppo_trainer" in message
    assert "put _self_ after ppo_trainer" in message


@pytest.mark.parametrize("entries", ["  - ppo_trainer\n  - override /algorithm: grpo\n", "  - my_base\n  - _self_\n"])
def test_a_defaults_list_naming_other_files_is_refused_saying_it_is_not_read(tmp_path, entries):
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text(f"defaults:\n{entries}data:\n  train_batch_size: 64\n")
    with pytest.raises(ConfigError) as info:
        load_config(config_file=experiment, notice=lambda _: None, validate=False)
    message = "\n".join(info.value.errors)
    assert f"config file {experiment}: its Hydra defaults list" in message
    assert "is not read here" in message and "Write the keys you need from them into this file directly" in message
    assert "did you mean" not in message


@pytest.mark.parametrize(("key", "meant"), [
    ("model.lora_rank", "actor_rollout_ref.model.lora_rank"),
    ("model.lora_rnk", "actor_rollout_ref.model.lora_rank"),
    ("optim.lr", "actor_rollout_ref.actor.optim.lr"),
    ("ppo_epochs", "actor_rollout_ref.actor.ppo_epochs"),
    ("critic.model.lora_rnk", "critic.model.lora_rank"),  # a key in the critic's section stays there
    ("shuffle", "data.shuffle"),
    # verl's short forms of the policy's sections (the critic's key and data.shuffle were suggested)
    ("actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("actor.optim.lr", "actor_rollout_ref.actor.optim.lr"),
    ("actor.shuffle", "actor_rollout_ref.actor.shuffle"),
    ("ref.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    ("rollout.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
])
def test_a_key_without_its_section_is_suggested_in_the_policys(key, meant):
    assert _errors_or_none(f"{key}=1") == f"unknown config key {key}; did you mean {meant}?"


def test_verls_old_val_generations_to_log_to_wandb_is_an_alias_of_log_val_generations():
    notices = []
    cfg = load_config(["trainer.val_generations_to_log_to_wandb=10"], notice=notices.append, validate=False)
    assert cfg.trainer.log_val_generations == 10
    assert notices == ["notice: trainer.val_generations_to_log_to_wandb is an alias; use trainer.log_val_generations"]


@pytest.mark.parametrize(("overrides", "error"), [
    (["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=-1", "actor_rollout_ref.actor.use_kl_loss=true"],
     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=-1 must be > 0"),
    (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0"],
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0 must be > 0"),
    (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null"],
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu is required when "
     "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is off"),
])
def test_a_log_prob_micro_batch_size_that_cuts_no_micro_batches_is_refused(overrides, error):
    """-1 cut none (an IndexError at the first old-log-prob or reference pass, after the models loaded); 0 or null
    without dynamic batching ran the whole batch in one forward."""
    assert _errors(*overrides) == error


def test_a_null_log_prob_micro_batch_size_is_taken_where_it_is_not_used():
    load_config(["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null",
                 "actor_rollout_ref.actor.use_dynamic_bsz=true"], notice=lambda _: None)  # cut by tokens
    load_config(["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=null"])  # no KL: no reference pass


def test_the_suggested_mini_batch_for_a_train_batch_of_48_makes_whole_micro_batches():
    # 4 workers of 16-sequence micro-batches, 4 responses a prompt: a mini-batch of d prompts is 4d sequences, a
    # multiple of 64 only where d is one of 16; of 48's divisors 16 and 48 are, and 16 is the nearer to 20 (24,
    # as near to 20 and a divisor, is 96 sequences: a micro-batch and a half on each worker)
    sizes = ["data.train_batch_size=48", "actor_rollout_ref.rollout.n=4", "trainer.n_gpus_per_node=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "critic.ppo_micro_batch_size_per_gpu=16"]
    message = _errors(*sizes, "actor_rollout_ref.actor.ppo_mini_batch_size=20")
    assert "must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size (20): set ppo_mini_batch_size to a " \
           "divisor, e.g. 16" in message
    # the critic follows the actor's mini-batch: its 8-sequence micro-batches need 4d a multiple of 32 (d of 8),
    # which 16 is, and with 32-sequence ones (d a multiple of 32) no divisor of 48 fits both: the train batch must
    # be a multiple of 32, 32 and 64 as near to 48
    message = _errors(*sizes, "actor_rollout_ref.actor.ppo_mini_batch_size=20",
                      "critic.ppo_micro_batch_size_per_gpu=32")
    assert "no divisor of it gives every worker whole micro-batches" in message
    assert "needs a multiple of 32 prompts: set data.train_batch_size to a multiple of 32 (e.g. 64)" in message


@pytest.mark.parametrize("gae", [True, False])
def test_every_suggested_mini_batch_passes_validation(gae):
    suggested = 0
    for total, n, workers, micro, critic_micro, mini, dynamic in [
        (48, 4, 4, 16, 16, 20, False), (48, 4, 8, 8, 8, 32, False), (48, 1, 1, 4, 4, 256, False),
        (96, 5, 2, 4, 2, 50, False), (60, 3, 4, 2, 6, 25, False), (120, 2, 8, 3, 5, 7, False),
        (72, 6, 8, 4, 4, 40, True), (30, 2, 3, 5, 5, 7, False), (64, 1, 2, 8, 4, 24, False),
    ]:
        sizes = [f"data.train_batch_size={total}", f"actor_rollout_ref.rollout.n={n}",
                 f"trainer.n_gpus_per_node={workers}", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                 f"critic.ppo_micro_batch_size_per_gpu={critic_micro}",
                 f"actor_rollout_ref.actor.use_dynamic_bsz={dynamic}",
                 f"algorithm.adv_estimator={'gae' if gae else 'grpo'}"]
        message = _errors(*sizes, f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}")
        hint = re.search(rf"ppo_mini_batch_size \({mini}\): set ppo_mini_batch_size to a divisor, e\.g\. (\d+)",
                         message)
        if hint is None:  # no divisor fits: the error says which multiple the train batch must be instead
            step = int(re.search(r"set data\.train_batch_size to a multiple of (\d+)", message).group(1))
            assert total % step
            continue
        suggested += 1
        load_config([*sizes, f"actor_rollout_ref.actor.ppo_mini_batch_size={hint.group(1)}"], notice=lambda _: None)
    assert suggested >= 6


@pytest.mark.parametrize("section", ["actor_rollout_ref.actor", "critic"])
def test_verls_old_checkpoint_contents_is_an_alias_of_save_contents(section):
    """verl's scripts before its split into save_contents and load_contents wrote checkpoint.contents=[...]."""
    notices = []
    load_config([f"{section}.checkpoint.contents=[model,optimizer,extra,hf_model]"], notice=notices.append,
                validate=False)
    assert notices[0] == f"notice: {section}.checkpoint.contents is an alias; use {section}.checkpoint.save_contents"
    assert notices[1].startswith(f"notice: {section}.checkpoint.save_contents=['model', 'optimizer', 'extra', "
                                 "'hf_model'] has no effect: ")
    # what save_contents refuses, its old name refuses too (a checkpoint here always holds the optimizer)
    assert f"{section}.checkpoint.save_contents=['model'] is not supported" in _errors(
        f"{section}.checkpoint.contents=[model]")
    assert _errors_or_none(f"~{section}.checkpoint.contents") is None


def test_the_critics_checkpoint_notice_does_not_promise_a_huggingface_export():
    notices = []
    load_config(["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
                 "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]"], notice=notices.append,
                validate=False)
    actor, critic = (n.split("has no effect: ")[1] for n in notices)
    assert "with a huggingface/ export" in actor  # actor/huggingface/ is written with every checkpoint
    assert "without a huggingface/ export" in critic  # critic/ holds model_state.pt, optim_state.pt, extra_state.pt


def test_verls_ray_runtime_env_is_taken_as_trainer_ray_runtime_env(tmp_path):
    notices = []
    cfg = load_config(["+ray_kwargs.ray_init.runtime_env.env_vars.TOKENIZERS_PARALLELISM=false",
                       "ray_kwargs.ray_init.num_cpus=null"], notice=notices.append, validate=False)
    assert cfg.trainer.ray_runtime_env == {"env_vars": {"TOKENIZERS_PARALLELISM": False}}  # as Hydra reads it
    assert [n.split(" has no effect")[0] for n in notices] == ["notice: ray_kwargs.ray_init.num_cpus=None"]
    whole = load_config(["ray_kwargs.ray_init.runtime_env={py_modules:[/shared/my_arch]}"], validate=False)
    assert whole.trainer.ray_runtime_env == {"py_modules": ["/shared/my_arch"]}
    path = tmp_path / "verl.yaml"
    path.write_text("ray_kwargs:\n  ray_init:\n    num_cpus: null\n    runtime_env:\n      working_dir: /shared/job\n"
                    "      env_vars: {VLLM_USE_V1: '1'}\n")
    from_file = load_config([], config_file=path, notice=lambda _: None, validate=False)
    assert from_file.trainer.ray_runtime_env == {"working_dir": "/shared/job", "env_vars": {"VLLM_USE_V1": "1"}}
    assert load_config([], validate=False).trainer.ray_runtime_env == {}


def test_verls_ray_init_address_is_the_cluster_joined(tmp_path):
    """verl hands ray_kwargs.ray_init to ray.init, so its address is the cluster a verl run joins: here it had no
    effect but a notice, and the run started a local cluster of its own instead (one where nothing answers at that
    address was never refused)."""
    notices = []
    cfg = load_config(["+ray_kwargs.ray_init.address=10.0.0.9:6379"], notice=notices.append, validate=False)
    assert cfg.trainer.ray_address == "10.0.0.9:6379" and notices == []
    path = tmp_path / "verl.yaml"
    path.write_text("ray_kwargs:\n  ray_init:\n    address: ray://head:10001\n")
    assert load_config([], config_file=path, validate=False).trainer.ray_address == "ray://head:10001"
    assert load_config([], validate=False).trainer.ray_address is None


def test_a_key_misspelt_in_a_config_file_names_the_file(tmp_path):
    """With several files (or one a pipeline names), the problem names the file whose key it is; an override's
    problem names none."""
    base, experiment = tmp_path / "base.yaml", tmp_path / "experiment.yaml"
    base.write_text("trainer:\n  total_epochs: 2\n")
    experiment.write_text("trainer:\n  total_trainig_steps: 5\n")
    with pytest.raises(ConfigError) as error:
        load_config(["data.train_batch_sise=4"], config_file=[base, experiment], notice=lambda _: None)
    assert error.value.errors == [
        f"unknown config key trainer.total_trainig_steps; did you mean trainer.total_training_steps? (in {experiment})",
        "unknown config key data.train_batch_sise; did you mean data.train_batch_size?"]


@pytest.mark.parametrize("hydra_override", [
    "hydra.run.dir=/tmp/hydra-outputs",  # as verl commands pass it: Hydra's run folder
    "+hydra.job.chdir=True",
    "hydra/job_logging=disabled",  # a Hydra group chosen on the command line
    "~hydra.output_subdir",
])
def test_hydras_own_settings_on_the_command_line_are_dropped_with_a_notice(hydra_override):
    # the command line's counterpart of a config file's hydra: section, which is dropped with a notice: Hydra
    # does not load the config here, so its settings are no key of the tree to refuse as unknown
    notices = []
    cfg = load_config([hydra_override, "data.train_batch_size=64"], notice=notices.append, validate=False)
    assert cfg.data.train_batch_size == 64
    assert [n for n in notices if n.startswith(f"notice: {hydra_override} is Hydra's own setting")]


# keys newer verl's generated trainer config adds (its optimizer choice, the engine settings each fsdp_config repeats,
# the rollout's parallel sizes, the reward model's own pool), at verl's defaults: a full config file of that verl holds
# them, so each is taken with a notice, and none changes a setting
NEWER_VERL_DEFAULTS_WITHOUT_COUNTERPART = """
actor_rollout_ref.actor.optim.optimizer=AdamW actor_rollout_ref.actor.optim.optimizer_impl=torch.optim
actor_rollout_ref.actor.optim.override_optimizer_config=null
critic.optim.optimizer=AdamW critic.optim.optimizer_impl=torch.optim critic.optim.override_optimizer_config=null
actor_rollout_ref.actor.fsdp_config.use_orig_params=false actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1
actor_rollout_ref.actor.fsdp_config.entropy_from_logits_with_chunking=false
actor_rollout_ref.actor.fsdp_config.use_torch_compile=true actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=false
actor_rollout_ref.actor.fsdp_config.forward_only=false actor_rollout_ref.actor.fsdp_config.strategy=fsdp
actor_rollout_ref.ref.fsdp_config.use_orig_params=false actor_rollout_ref.ref.fsdp_config.forward_only=false
actor_rollout_ref.ref.fsdp_config.strategy=fsdp critic.model.fsdp_config.use_orig_params=false
critic.model.fsdp_config.ulysses_sequence_parallel_size=1 critic.model.fsdp_config.use_torch_compile=true
actor_rollout_ref.actor.freeze_vision_tower=false actor_rollout_ref.model.hf_config_path=null
actor_rollout_ref.rollout.data_parallel_size=1 actor_rollout_ref.rollout.expert_parallel_size=1
actor_rollout_ref.rollout.skip_tokenizer_init=true
reward_model.enable_resource_pool=false reward_model.n_gpus_per_node=0 reward_model.nnodes=0
""".split()


def test_newer_verl_generated_config_keys_are_all_taken():
    notices = []
    cfg = load_config(NEWER_VERL_DEFAULTS_WITHOUT_COUNTERPART, notice=notices.append, validate=False)
    assert cfg == load_config([], notice=lambda _: None, validate=False)
    for override in NEWER_VERL_DEFAULTS_WITHOUT_COUNTERPART:
        key = override.partition("=")[0]
        assert [n for n in notices if n.startswith(f"notice: {key}=") and " has no effect: " in n], key


@pytest.mark.parametrize(("override", "said"), [
    ("actor_rollout_ref.actor.optim.optimizer=AdamW8bit", "the optimizer is torch.optim.AdamW"),
    ("critic.optim.optimizer_impl=bitsandbytes.optim", "the optimizer is torch.optim.AdamW"),
    ("actor_rollout_ref.actor.optim.override_optimizer_config={fused: true}", "torch's defaults"),
    ("critic.model.fsdp_config.ulysses_sequence_parallel_size=2", "there is no sequence parallelism here"),
    ("actor_rollout_ref.rollout.expert_parallel_size=4", "there is no expert parallelism here"),
    ("reward_model.enable_resource_pool=true", "the reward model runs in the trainer's workers"),
])
def test_newer_verl_keys_asking_for_what_is_not_here_are_refused(override, said):
    message = _errors(override)
    assert f"{override.partition('=')[0]}=" in message and "is not supported" in message and said in message


def test_verls_wandb_proxy_is_refused_naming_the_variable_wandb_reads():
    # verl passes +trainer.wandb_proxy to wandb's settings; here wandb reads HTTPS_PROXY, which the refusal names
    # (it was an unknown key, with trainer.val_only as the closest one)
    message = _errors("+trainer.wandb_proxy=http://proxy:8080")
    assert "trainer.wandb_proxy='http://proxy:8080' is not supported: wandb takes its proxy from the HTTPS_PROXY " \
        "environment variable" in message
    notices = []
    load_config(["trainer.wandb_proxy=null"], notice=notices.append, validate=False)
    assert any(n.startswith("notice: trainer.wandb_proxy=None has no effect") for n in notices)


@pytest.mark.parametrize(("override", "said"), [
    ("trainer.experiment_name=${trainer.no_such_key}", "Interpolation key 'trainer.no_such_key' not found"),
    # Hydra's own resolver, which verl's Hydra registers: refused, saying how to give the date instead
    ("trainer.experiment_name=run_${now:%Y%m%d}", "Hydra's ${now:...} is not registered here"),
])
def test_a_failing_interpolation_is_said_of_the_key_that_holds_it(override, said):
    # the experiment's name is read first by reward_model.train.default_local_dir, which the user never set: the
    # problem is said of the key given, with the key that read it beside it
    message = _errors_or_none(override)
    assert message is not None and message.startswith("trainer.experiment_name: "), message
    assert said in message and "(read by reward_model.train.default_local_dir)" in message


def test_none_written_for_null_is_refused_with_the_null_to_write():
    # Hydra reads None as the text 'None' (as verl's does): where the key takes null, the refusal says to write that
    assert "None is read as text: write trainer.total_training_steps=null" in \
        _errors_or_none("trainer.total_training_steps=None")
    message = _errors_or_none("data.max_prompt_length=None")  # no null to offer where the key takes none
    assert message is not None and "data.max_prompt_length='None'" in message and "write" not in message


def _refusals(overrides, config_file=None):
    with pytest.raises(ConfigError) as info:
        load_config(overrides, config_file=config_file, notice=lambda _: None, validate=False)
    return info.value.errors


def test_a_failing_interpolation_is_said_of_the_key_whose_own_value_fails(tmp_path):
    # the file's checkpoint folder reads the experiment's name, whose ${now:...} is what fails: the folder was blamed
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  default_local_dir: /data/ckpt/${trainer.experiment_name}\n")
    [message] = _refusals(["trainer.experiment_name=run_${now:%Y%m%d}"], path)
    assert message.startswith("trainer.experiment_name: Unsupported interpolation type now"), message
    assert "e.g. trainer.experiment_name=run_$(date +%Y%m%d)" in message
    # two keys broken each their own way: each is said with its own problem (one's was pinned on the other)
    errors = _refusals(["trainer.experiment_name=run_${now:%Y}", "trainer.project_name=${trainer.nope}"])
    assert sorted(e.split(";")[0].split(" (read by")[0] for e in errors) == [
        "trainer.experiment_name: Unsupported interpolation type now",
        "trainer.project_name: Interpolation key 'trainer.nope' not found"]
    # the date to give is the failing key's, not always the experiment's name
    [message] = _refusals(["trainer.project_name=${now:%Y}"])
    assert message.startswith("trainer.project_name: ") and "e.g. trainer.project_name=$(date +%Y)" in message
    assert "trainer.experiment_name" not in message


def test_a_config_files_now_interpolation_asks_for_the_date_written_in_the_file(tmp_path):
    # a shell's $(date ...) is not run in a YAML file: the value is to be written there
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  experiment_name: run_${now:%Y}\n")
    [message] = _refusals([], path)
    assert message.startswith("trainer.experiment_name: ") and "$(date" not in message
    assert f"write the value itself in {path}, e.g. experiment_name: run_{datetime.date.today().year}" in message


@pytest.mark.parametrize(("written", "shape"), [("${now:%Y%m%d_%H%M%S}", r"\d{8}_\d{6}"),
                                               ("${now:%H:%M}", r"\d\d:\d\d")])
def test_a_config_files_date_that_yaml_reads_as_a_number_is_advised_quoted(written, shape, tmp_path):
    # the date written bare (experiment_name: 20261206_105832) is read by YAML as an int, 10:58 as minutes: the
    # advice followed named the experiment 20261206105832 or 658
    path = tmp_path / "run.yaml"
    path.write_text(f"trainer:\n  experiment_name: {written}\n")
    [message] = _refusals([], path)
    line = message.rpartition("e.g. ")[2]
    path.write_text(f"trainer:\n  {line}\n")  # the advice followed
    name = load_config(config_file=path, notice=lambda _: None, validate=False).trainer.experiment_name
    assert re.fullmatch(shape, name), (line, name)


@pytest.mark.parametrize(("section", "written", "advised", "read"), [
    # a list item: the list is written again with the date in its item
    ("data", "val_files: [a.parquet, 'b_${now:%Y}.parquet']", "val_files: [a.parquet, b_{year}.parquet]",
     ("data.val_files", ["a.parquet", "b_{year}.parquet"])),
    # an entry deep in an open mapping: the mapping is written again, not a dotted key of the command line
    ("trainer", "ray_runtime_env:\n    env_vars:\n      RUN: run_${now:%Y}\n      MODE: x",
     "ray_runtime_env: {env_vars: {RUN: run_{year}, MODE: x}}",
     ("trainer.ray_runtime_env", {"env_vars": {"RUN": "run_{year}", "MODE": "x"}})),
])
def test_a_config_files_now_inside_a_list_or_mapping_asks_for_the_value_written_in_the_file(
        section, written, advised, read, tmp_path):
    # the date was asked from the shell for a dotted key (data.val_files[1]=...) that no file or command line takes
    year = datetime.date.today().year
    path = tmp_path / "run.yaml"
    path.write_text(f"{section}:\n  {written}\n")
    [message] = _refusals([], path)
    assert "$(date" not in message and message.endswith("e.g. " + advised.replace("{year}", str(year))), message
    path.write_text(f"{section}:\n  {message.rpartition('e.g. ')[2]}\n")  # the advice followed
    key, value = read
    assert attribute(load_config(config_file=path, notice=lambda _: None, validate=False), key) == \
        json.loads(json.dumps(value).replace("{year}", str(year)))


def test_a_command_lines_now_inside_a_list_asks_for_the_whole_list_from_the_shell():
    # data.val_files[1]=... is no override: the list is given whole, the shell writing the date into its item
    [message] = _refusals(["data.val_files=[a.parquet,'b_${now:%Y}.parquet']"])
    assert message.endswith('e.g. data.val_files="[a.parquet, b_$(date +%Y).parquet]"'), message
    (override,) = shlex.split(subprocess.run(["bash", "-c", f"printf '%q' {message.rpartition('e.g. ')[2]}"],
                                             capture_output=True, text=True, check=True).stdout)
    assert load_config([override], notice=lambda _: None, validate=False).data.val_files == [
        "a.parquet", f"b_{datetime.date.today().year}.parquet"]


def test_a_command_lines_date_that_hydra_reads_as_a_number_is_advised_quoted():
    # trainer.experiment_name=$(date +%Y%m%d_%H%M%S) gives Hydra 20261206_105832, an int to it: the advice followed
    # named the experiment 20261206105832 (verl's ${now:...} gives the text)
    [message] = _refusals(["trainer.experiment_name=${now:%Y%m%d_%H%M%S}"])
    override = subprocess.run(["bash", "-c", f"printf '%s' {message.rpartition('e.g. ')[2]}"],
                              capture_output=True, text=True, check=True).stdout  # the advice run by a shell
    name = load_config([override], notice=lambda _: None, validate=False).trainer.experiment_name
    assert re.fullmatch(r"\d{8}_\d{6}", name), (override, name)


@pytest.mark.parametrize(("given", "advised", "key", "dated", "shape"), [
    ("data.val_files=[a.parquet,${now:%Y%m%d}]", "data.val_files=\"[a.parquet, '$(date +%Y%m%d)']\"",
     "data.val_files", lambda files: files[1], r"\d{8}"),
    ("trainer.ray_runtime_env={env_vars: {RUN: ${now:%Y%m%d_%H%M%S}}}",
     "trainer.ray_runtime_env=\"{env_vars: {RUN: '$(date +%Y%m%d_%H%M%S)'}}\"", "trainer.ray_runtime_env",
     lambda env: env["env_vars"]["RUN"], r"\d{8}_\d{6}"),
])
def test_a_command_lines_date_in_a_list_or_mapping_that_hydra_reads_as_a_number_is_advised_quoted(
        given, advised, key, dated, shape):
    # the shell's 20261206 in a list was read by Hydra as an int (then refused as no file name), and an env
    # var 20261206_105832 as the number 20261206105832: the item is quoted for Hydra inside the shell's quotes
    [message] = _refusals([given])
    assert message.endswith(f"e.g. {advised}"), message
    (override,) = shlex.split(subprocess.run(["bash", "-c", f"printf '%q' {message.rpartition('e.g. ')[2]}"],
                                             capture_output=True, text=True, check=True).stdout)
    item = dated(attribute(load_config([override], notice=lambda _: None, validate=False), key))
    assert isinstance(item, str) and re.fullmatch(shape, item), (override, item)


def test_a_malformed_interpolation_is_a_config_error_naming_where_it_is(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text('trainer:\n  experiment_name: "run_${oops"\n')
    [message] = _refusals([], path)
    assert message.startswith(f"config file {path}: trainer.experiment_name holds a ${{...}} that does not parse")
    [message] = _refusals(["trainer.experiment_name='run_${oops'"])
    assert message.startswith("trainer.experiment_name='run_${oops' holds a ${...} that does not parse")


@pytest.mark.parametrize("key", ["critic.model.path", "custom_reward_function.path", "trainer.resume_from_path",
                                 "actor_rollout_ref.model.tokenizer_path"])
def test_none_written_for_null_on_a_text_key_is_refused(key):
    # the text 'None' is a valid value of a text key, so it went through to fail later as a path named None
    assert _refusals([f"{key}=None"]) == [f"{key}='None': None is read as text: write {key}=null"]


def test_none_written_for_no_validation_files_is_told_the_empty_list_that_is_taken(tmp_path):
    # data.val_files=null is refused by validation (no validation is written []): advising it made two
    # refusals of one mistake
    assert _refusals(["data.val_files=None"]) == [
        "data.val_files='None': None is read as text: write data.val_files=[] (no validation)"]
    assert load_config(["data.val_files=[]"], notice=lambda _: None).data.val_files == []
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  val_files: None\n")
    assert _refusals([], path) == [
        f"data.val_files='None': None is read as text: write val_files: [] under data (no validation) (in {path})"]
    path.write_text("data:\n  val_files: []\n")
    assert load_config(config_file=path, notice=lambda _: None).data.val_files == []


@pytest.mark.parametrize("key", ["data.train_files", "actor_rollout_ref.model.target_modules",
                                 "reward_model.train.train_files"])
def test_none_written_on_a_key_without_null_is_told_what_it_takes(key, tmp_path):
    # these take a string or a list and no null: the advised KEY=null was refused in turn by validation
    message = f"{key}='None': None is read as text, and {key} takes no null: a string or a list, e.g. "
    assert _refusals([f"{key}=None"]) == [message + f"{key}=[a,b]"]
    with pytest.raises(ConfigError) as info:  # as KEY=null would have been, by validation
        load_config([f"{key}=null"], notice=lambda _: None)
    assert f"{key}=None must be a string or a list of strings, e.g. {key}=[a,b]" in info.value.errors
    section, _, name = key.rpartition(".")
    path = tmp_path / "run.yaml"
    path.write_text("".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(section.split(".")))
                    + f"{'  ' * (section.count('.') + 1)}{name}: None\n")
    assert _refusals([], path) == [message + f"{name}: [a, b] under {section} (in {path})"]


def test_none_written_for_no_held_out_pairs_is_told_null_which_is_taken():
    key = "reward_model.train.val_files"
    assert _refusals([f"{key}=None"]) == [f"{key}='None': None is read as text: write {key}=null"]
    assert attribute(load_config([f"{key}=null"], notice=lambda _: None), key) is None


@pytest.mark.parametrize(("section", "name"), [("trainer", "total_training_steps"), ("data", "tokenizer"),
                                               ("actor_rollout_ref.model", "tokenizer_path")])
def test_none_written_for_null_in_a_config_file_is_told_the_files_null(section, name, tmp_path):
    # a file's keys are written name: value under their section, not KEY=null as on the command line
    path = tmp_path / "run.yaml"
    path.write_text("".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(section.split(".")))
                    + f"{'  ' * (section.count('.') + 1)}{name}: None\n")
    assert _refusals([], path) == [
        f"{section}.{name}='None': None is read as text: write {name}: null under {section} (in {path})"]
    path.write_text(path.read_text().replace("None", "null"))  # the advice followed: taken
    assert attribute(load_config(config_file=path, notice=lambda _: None, validate=False), f"{section}.{name}") is None


@pytest.mark.parametrize("key", ["critic.ppo_micro_batch_size", "actor_rollout_ref.rollout.log_prob_micro_batch_size",
                                 "critic.optim.min_lr_ratio", "reward_model.micro_batch_size_per_gpu"])
def test_none_written_for_null_on_a_verl_key_whose_null_sets_nothing_is_refused_as_such(key, tmp_path):
    # each takes null (it sets nothing); the text 'None' was said as two sizes set at once, a value not
    # supported or a type it could not be converted to
    assert _refusals([f"{key}=None"]) == [f"{key}='None': None is read as text: write {key}=null"]
    load_config([f"{key}=null"], notice=lambda _: None, validate=False)
    path = tmp_path / "run.yaml"  # YAML reads None as the text too
    section, _, name = key.rpartition(".")
    path.write_text("".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(section.split(".")))
                    + f"{'  ' * (section.count('.') + 1)}{name}: None\n")
    assert _refusals([], path) == [f"{key}='None': None is read as text: write {name}: null under {section} (in {path})"]


@pytest.mark.parametrize("key", ["critic.model.external_lib", "actor_rollout_ref.actor.use_remove_padding",
                                 "critic.enable", "actor_rollout_ref.actor.optim.max_grad_norm",
                                 "trainer.remove_previous_ckpt_in_save"])
def test_none_written_for_null_on_a_mirror_the_critics_switch_an_alias_or_a_switch_is_told_its_null(key, tmp_path):
    # each takes null (a repeat of another key, the estimator's choice of critic, verl's unused alias, a switch
    # left off): the text was said to differ from the key it repeats (external_lib's None), as not supported, as
    # a float it could not be, or as an unknown key
    assert _refusals([f"{key}=None"]) == [f"{key}='None': None is read as text: write {key}=null"]
    load_config([f"{key}=null"], notice=lambda _: None)  # the advice followed: taken, validated
    path = tmp_path / "run.yaml"
    section, _, name = key.rpartition(".")
    path.write_text("".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(section.split(".")))
                    + f"{'  ' * (section.count('.') + 1)}{name}: None\n")
    assert _refusals([], path) == [f"{key}='None': None is read as text: write {name}: null under {section} (in {path})"]
    path.write_text(path.read_text().replace("None", "null"))
    load_config(config_file=path, notice=lambda _: None)


@pytest.mark.parametrize("section", ["actor_rollout_ref.actor", "critic"])
def test_none_written_for_a_null_micro_batch_size_is_told_the_choices_that_are_taken(section, tmp_path):
    # KEY=null alone was advised, then refused in turn: the size is required when use_dynamic_bsz is off
    key = f"{section}.ppo_micro_batch_size_per_gpu"
    assert _refusals([f"{key}=None"]) == [
        f"{key}='None': None is read as text: write {key}=null with {section}.use_dynamic_bsz=True; without "
        f"dynamic batching it takes a size, e.g. {key}=4 (or {section}.ppo_micro_batch_size over all workers "
        "in its place)"]
    for choice in ([f"{key}=null", f"{section}.use_dynamic_bsz=True"], [f"{key}=4"],
                   [f"{key}=null", f"{section}.ppo_micro_batch_size=8"]):  # each followed: taken, validated
        load_config(choice, notice=lambda _: None)
    path = tmp_path / "run.yaml"
    indent = "  " * (section.count(".") + 1)
    path.write_text("".join(f"{'  ' * depth}{part}:\n" for depth, part in enumerate(section.split(".")))
                    + f"{indent}ppo_micro_batch_size_per_gpu: None\n")
    assert _refusals([], path) == [
        f"{key}='None': None is read as text: write ppo_micro_batch_size_per_gpu: null and use_dynamic_bsz: "
        f"true under {section}; without dynamic batching it takes a size, e.g. "
        f"ppo_micro_batch_size_per_gpu: 4 (or ppo_micro_batch_size over all workers in its place) "
        f"(in {path})"]
    path.write_text(path.read_text().replace("None", f"null\n{indent}use_dynamic_bsz: true"))  # followed
    load_config(config_file=path, notice=lambda _: None)


def test_verl_0_7s_null_reward_model_pool_is_taken_at_the_defaults(tmp_path):
    # verl 0.7's generated config holds the reward model's own pool as nulls
    path = tmp_path / "run.yaml"
    path.write_text("reward_model:\n  enable_resource_pool: null\n  n_gpus_per_node: null\n  nnodes: null\n")
    notices = []
    cfg = load_config(config_file=path, notice=notices.append, validate=False)
    assert cfg == load_config([], notice=lambda _: None, validate=False)
    for key in ("enable_resource_pool", "n_gpus_per_node", "nnodes"):
        assert [n for n in notices if n.startswith(f"notice: reward_model.{key}=None has no effect: ")], key
    assert "is not supported" in _errors("reward_model.enable_resource_pool=true")  # the pool itself


POOL_UNREAD = ("read only with reward_model.enable_resource_pool, which is not supported here: the reward model runs "
               "in the trainer's workers")


@pytest.mark.parametrize(("overrides", "said"), [
    # verl's defaults of the reward model's own pool (reward.yaml: 8 GPUs a node, 0 nodes)
    (["reward_model.n_gpus_per_node=8", "reward_model.nnodes=0"],
     [f"notice: reward_model.n_gpus_per_node=8 has no effect: {POOL_UNREAD}",
      f"notice: reward_model.nnodes=0 has no effect: {POOL_UNREAD}"]),
    (["reward.reward_model.n_gpus_per_node=8"],
     ["notice: reward.reward_model.n_gpus_per_node is newer verl's name of reward_model.n_gpus_per_node, taken as it",
      f"notice: reward_model.n_gpus_per_node=8 has no effect: {POOL_UNREAD}"]),
    (["reward_model.nnodes=2"], [f"notice: reward_model.nnodes=2 has no effect: {POOL_UNREAD}"]),
])
def test_the_reward_models_own_pool_size_is_taken_as_unread(overrides, said):
    # verl sizes the reward model's pool only with enable_resource_pool=true (refused here on its own): its default
    # n_gpus_per_node=8 was refused as asking for that pool
    notices = []
    assert load_config(overrides, notice=notices.append) == load_config([], notice=lambda _: None)
    assert notices == said


def test_an_interpolation_between_two_keys_without_effect_is_judged_by_what_it_resolves_to(tmp_path):
    # verl's ppo_trainer.yaml has the reference's sequence-parallel size follow the actor's; both set nothing here,
    # and the reference's was refused as not supported although it stands for 1
    actor, ref = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                  "actor_rollout_ref.ref.ulysses_sequence_parallel_size")
    unread = "has no effect: there is no sequence parallelism here"
    notices = []
    assert load_config([f"{actor}=1", f"{ref}=${{{actor}}}"], notice=notices.append) == \
        load_config([], notice=lambda _: None)
    assert notices == [f"notice: {actor}=1 {unread}", f"notice: {ref}=1 {unread}"]
    path = tmp_path / "verl.yaml"  # the file's order: the reference's after the actor's, reading it
    path.write_text(f"actor_rollout_ref:\n  actor:\n    ulysses_sequence_parallel_size: 1\n  ref:\n"
                    f"    ulysses_sequence_parallel_size: ${{{actor}}}\n")
    notices = []
    load_config(config_file=path, notice=notices.append)
    assert notices == [f"notice: {actor}=1 {unread}", f"notice: {ref}=1 {unread}"]
    # what it resolves to is judged as written: 2 asks for sequence parallelism, for both
    assert _refusals([f"{ref}=${{{actor}}}", f"{actor}=2"]) == [
        f"{actor}=2 is not supported: there is no sequence parallelism here",
        f"{ref}=2 is not supported: there is no sequence parallelism here"]


def test_an_optimizer_override_set_entry_by_entry_is_refused_as_the_whole_mapping_is(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      override_optimizer_config:\n        fused: true\n")
    [message] = _refusals([], path)
    assert message.startswith("actor_rollout_ref.actor.optim.override_optimizer_config.fused=True is not supported: "
                              "AdamW takes optim.lr, betas and weight_decay, and torch's defaults else"), message
    [message] = _refusals(["+critic.optim.override_optimizer_config.fused=true"])
    assert message.startswith("critic.optim.override_optimizer_config.fused=True is not supported: AdamW takes")


@pytest.mark.parametrize(("section", "model"), [("critic.model.fsdp_config", "the critic"),
                                                ("critic.fsdp_config", "the critic"),
                                                ("reward_model.model.fsdp_config", "the reward model")])
def test_compiling_the_critic_or_reward_model_is_said_to_be_not_done(section, model):
    # only the actor (and its reference) is compiled: the notice said the actor's key decides for these
    notices = []
    load_config([f"{section}.use_torch_compile=true"], notice=notices.append, validate=False)
    assert notices == [f"notice: {section}.use_torch_compile=True has no effect: {model} is not compiled here "
                       "(only the actor and its reference are, with actor_rollout_ref.actor.use_torch_compile)"]


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.optim.optimizer", "critic.model.fsdp_config.fsdp_size"])
def test_an_interpolation_that_gives_null_is_judged_as_a_written_null(key, monkeypatch):
    monkeypatch.delenv("UNSET_VAR_X", raising=False)
    assert _refusals([f"{key}=null"]) == _refusals([f"{key}=${{oc.env:UNSET_VAR_X,null}}"])
    assert f"{key}=None is not supported" in _refusals([f"{key}=null"])[0]


@pytest.mark.parametrize(("written", "text"), [
    (r"run_\${oops", "run_${oops"),
    (r"lit_\${trainer.project_name}", "lit_${trainer.project_name}"),
    (r"x\\\${trainer.project_name}", "x\\${trainer.project_name}"),  # OmegaConf: \\ a backslash, \${ the text ${
])
def test_a_literal_interpolation_survives_the_trip_between_pipeline_steps(written, text):
    # written \${...}, the text ${...} is the value; the pipeline hands the config on as to_dict() and each step
    # reads it with from_dict, which read that text as an interpolation again (a traceback, or another key's value)
    from rlhf_core.config import PPOConfig

    cfg = load_config([f"trainer.experiment_name='{written}'", r"+custom_reward_function.reward_kwargs.tag='\${x}'"],
                      notice=lambda _notice: None)
    assert cfg.trainer.experiment_name == text
    again = PPOConfig.from_dict(cfg.to_dict())
    assert again.trainer.experiment_name == text
    assert again.custom_reward_function.reward_kwargs == {"tag": "${x}"}


def test_a_resume_path_that_its_resume_mode_does_not_read_is_said_so():
    """trainer.resume_from_path is read with resume_mode=resume_path only: given with the default auto, a run
    in an empty folder trained from the model, and one in a folder of checkpoints went on from their latest,
    without a word that the checkpoint asked for was left aside."""
    def resume_notices(*overrides):
        said = []
        load_config(list(overrides), notice=said.append)
        return [message for message in said if "resume_from_path" in message]

    assert resume_notices("trainer.resume_from_path=ckpt/global_step_5") == [
        "notice: trainer.resume_from_path=ckpt/global_step_5 is not read: trainer.resume_mode=auto resumes from the "
        "latest checkpoint in trainer.default_local_dir, and starts a new run where there is none; to resume from "
        "that checkpoint, set trainer.resume_mode=resume_path"]
    assert resume_notices("trainer.resume_mode=disable", "reward_model.train.resume_from_path=rm/global_step_2") == [
        "notice: reward_model.train.resume_from_path=rm/global_step_2 is not read: reward_model.train.resume_mode="
        "auto resumes from the latest checkpoint in reward_model.train.default_local_dir, and starts a new run where "
        "there is none; to resume from that checkpoint, set reward_model.train.resume_mode=resume_path"]
    assert resume_notices("trainer.resume_mode=disable", "trainer.resume_from_path=ckpt/global_step_5") == [
        "notice: trainer.resume_from_path=ckpt/global_step_5 is not read: trainer.resume_mode=disable starts a new "
        "run; to resume from that checkpoint, set trainer.resume_mode=resume_path"]
    # read where resume_path asks for it; nothing to say without one
    assert resume_notices("trainer.resume_mode=resume_path", "trainer.resume_from_path=ckpt/global_step_5") == []
    assert resume_notices("trainer.resume_mode=disable") == []


def _kl_term_notices(overrides, config_file=None):
    said = []
    load_config(overrides, config_file=config_file, notice=said.append)
    return [message for message in said if "no effect: actor_rollout_ref.actor.use_kl_loss" in message
            or "no effect: algorithm.use_kl_in_reward" in message or "both KL terms are on" in message]


def test_a_clip_ratio_whose_bounds_follow_it_is_said_to_clip_otherwise_in_verl():
    """verl's clip_ratio_low and clip_ratio_high default to 0.2 and come before clip_ratio, so a verl command's
    clip_ratio=0.1 alone clips at [0.8, 1.2] there; here the null bounds follow it: [0.9, 1.1]."""
    def clip_notices(*overrides):
        said = []
        cfg = load_config(list(overrides), notice=said.append)
        return cfg.actor_rollout_ref.actor, [message for message in said if "clip_ratio=" in message]

    actor, said = clip_notices("actor_rollout_ref.actor.clip_ratio=0.1")
    assert (actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high) == (0.1, None, None)
    assert said == ["notice: actor_rollout_ref.actor.clip_ratio=0.1 clips the ratio to [0.9, 1.1] here, "
                    "clip_ratio_low and clip_ratio_high (null) following it; verl's clip_ratio_low and clip_ratio_high "
                    "default to 0.2 and come first there, so verl clips the same command at [0.8, 1.2]; set "
                    "clip_ratio_low and clip_ratio_high to say which"]
    _, said = clip_notices("actor_rollout_ref.actor.clip_ratio=0.1", "actor_rollout_ref.actor.clip_ratio_high=0.28")
    assert said == ["notice: actor_rollout_ref.actor.clip_ratio=0.1 clips the ratio to [0.9, 1.28] here, "
                    "clip_ratio_low (null) following it; verl's clip_ratio_low and clip_ratio_high default to 0.2 and "
                    "come first there, so verl clips the same command at [0.8, 1.28]; set clip_ratio_low to say which"]
    # both bounds given, clip_ratio at verl's 0.2, or not set: both trainers clip alike
    for overrides in (("actor_rollout_ref.actor.clip_ratio=0.1", "actor_rollout_ref.actor.clip_ratio_low=0.1",
                       "actor_rollout_ref.actor.clip_ratio_high=0.1"), ("actor_rollout_ref.actor.clip_ratio=0.2",),
                      ("actor_rollout_ref.actor.clip_ratio_high=0.28",), ()):
        assert clip_notices(*overrides)[1] == [], overrides


def test_the_keys_of_a_kl_term_that_is_off_are_said_to_have_no_effect(tmp_path):
    """A GSM8K recipe's kl_loss_coef and kl_loss_type copied without use_kl_loss=true (or a kl_penalty without
    use_kl_in_reward=true) were taken without a word, and the run trained with no KL to the reference at all."""
    assert _kl_term_notices(["actor_rollout_ref.actor.kl_loss_coef=0.01",
                             "actor_rollout_ref.actor.kl_loss_type=low_var_kl"]) == [
        "notice: actor_rollout_ref.actor.kl_loss_coef=0.01 has no effect: actor_rollout_ref.actor.use_kl_loss=false, "
        "so the policy loss holds no KL term; set it true for that KL"]  # low_var_kl is the default: not named
    assert _kl_term_notices(["actor_rollout_ref.actor={kl_loss_coef: 0.5, kl_loss_type: k3+}"]) == [
        "notice: actor_rollout_ref.actor.kl_loss_coef=0.5, actor_rollout_ref.actor.kl_loss_type='k3+' have no "
        "effect: actor_rollout_ref.actor.use_kl_loss=false, so the policy loss holds no KL term; set it true for "
        "that KL"]
    assert _kl_term_notices(["algorithm.kl_penalty=low_var_kl"]) == [
        "notice: algorithm.kl_penalty='low_var_kl' has no effect: algorithm.use_kl_in_reward=false, so the rewards "
        "hold no KL penalty; set it true for that KL"]
    # read where their term is on; at their defaults, or not set, nothing to say
    assert _kl_term_notices(["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
                             "actor_rollout_ref.actor.kl_loss_type=k3"]) == []
    assert _kl_term_notices(["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=low_var_kl"]) == []
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    kl_loss_coef: 0.001\nalgorithm:\n  kl_penalty: kl\n")
    assert _kl_term_notices([], path) == []
    assert _kl_term_notices([]) == []


def test_both_kl_terms_on_at_once_is_said_with_both_coefficients():
    """The KL penalty in the rewards and the KL loss together hold the policy to the reference twice; verl says so
    at start, this trainer said nothing."""
    assert _kl_term_notices(["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true",
                             "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.02",
                             "actor_rollout_ref.actor.kl_loss_coef=0.05"]) == [
        "notice: both KL terms are on (algorithm.use_kl_in_reward=true and actor_rollout_ref.actor.use_kl_loss=true): "
        "the policy is held to the reference twice, by the KL penalty in the rewards (algorithm.kl_ctrl.kl_coef=0.02, "
        "adaptive) and by the KL loss (kl_loss_coef=0.05); set one of them false for one KL term"]
    assert _kl_term_notices(["algorithm.use_kl_in_reward=true"]) == []
    assert _kl_term_notices(["actor_rollout_ref.actor.use_kl_loss=true"]) == []


def test_the_kl_controller_set_in_a_run_without_kl_in_the_reward_is_said_to_have_no_effect(tmp_path):
    """algorithm.kl_ctrl sets the coefficient of the KL in the reward: with a KL loss alone (use_kl_in_reward=false)
    an adaptive controller was taken without a word, and the run's KL coefficient stayed kl_loss_coef."""
    def kl_ctrl_notices(overrides, config_file=None):
        said = []
        load_config(overrides, config_file=config_file, notice=said.append)
        return [message for message in said if "has no effect: algorithm.kl_ctrl" in message
                or "have no effect: algorithm.kl_ctrl" in message]

    assert kl_ctrl_notices(["algorithm.kl_ctrl.type=adaptive"]) == [
        "notice: algorithm.kl_ctrl.type='adaptive' has no effect: algorithm.kl_ctrl sets the coefficient of the KL in "
        "the reward, and algorithm.use_kl_in_reward=false; set it true for that KL, or for a KL loss set "
        "actor_rollout_ref.actor.use_kl_loss=true with its own kl_loss_coef (fixed)"]
    # a run whose KL loss is on is not told to turn it on: its coefficient is named, as the run takes it
    assert kl_ctrl_notices(["algorithm.kl_ctrl.type=adaptive", "actor_rollout_ref.actor.use_kl_loss=true",
                            "actor_rollout_ref.actor.kl_loss_coef=0.05"]) == [
        "notice: algorithm.kl_ctrl.type='adaptive' has no effect: algorithm.kl_ctrl sets the coefficient of the KL in "
        "the reward, and algorithm.use_kl_in_reward=false; set it true for that KL; the run's KL loss has its own "
        "coefficient, actor_rollout_ref.actor.kl_loss_coef=0.05 (fixed)"]
    [both] = kl_ctrl_notices(["+algorithm.kl_ctrl_target=0.5"])  # the verl guides' alias sets two keys
    # the section given as one mapping (Hydra's key={...}), on the command line or under algorithm
    [mapped] = kl_ctrl_notices(["algorithm.kl_ctrl={type: adaptive, kl_coef: 0.01}"])
    assert mapped.startswith("notice: algorithm.kl_ctrl.type='adaptive', algorithm.kl_ctrl.kl_coef=0.01 have no "
                             "effect"), mapped
    [nested] = kl_ctrl_notices(["algorithm={kl_ctrl: {target_kl: 0.5}}"])
    assert nested.startswith("notice: algorithm.kl_ctrl.target_kl=0.5 has no effect"), nested
    assert both.startswith("notice: algorithm.kl_ctrl.type='adaptive', algorithm.kl_ctrl.target_kl=0.5 have no effect")
    # read: with KL in the reward; at their defaults (as verl's generated config holds them); not set at all
    assert kl_ctrl_notices(["algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=true"]) == []
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  kl_ctrl:\n    type: fixed\n    kl_coef: 0.001\n")
    assert kl_ctrl_notices([], path) == []
    assert kl_ctrl_notices([]) == []


def test_validation_settings_that_a_greedy_validation_does_not_read_are_said(tmp_path):
    """val_kwargs.do_sample=false validates greedily whatever val_kwargs.temperature, top_p and top_k say (verl's
    vLLM rollout alike; its agent-loop rollout samples at val_kwargs.temperature whatever do_sample says), and so
    does a temperature of 0: a run given val_kwargs.temperature=0.6 and n=4 without do_sample=true validated on one
    greedy response four times over, its best@4 and maj@4 equal to mean@4, without a word."""
    def greedy_notices(overrides, config_file=None):
        said = []
        load_config(overrides, config_file=config_file, notice=said.append)
        return [message for message in said if "val_kwargs" in message]

    key = "actor_rollout_ref.rollout.val_kwargs"
    assert greedy_notices([f"{key}.temperature=0.6", f"{key}.n=4"]) == [
        f"notice: {key}.temperature=0.6 has no effect: {key}.do_sample=false validates greedily (verl's agent-loop "
        f"rollout samples at val_kwargs.temperature all the same), so each prompt's {key}.n=4 responses are one "
        f"response 4 times over (best@4, worst@4 and maj@4 equal to mean@4); set {key}.do_sample=true to sample"]
    assert greedy_notices([f"{key}.top_p=0.9", f"{key}.top_k=20"]) == [
        f"notice: {key}.top_p=0.9, {key}.top_k=20 have no effect: {key}.do_sample=false validates greedily (verl's "
        f"agent-loop rollout samples at val_kwargs.temperature all the same); set {key}.do_sample=true to sample"]
    assert greedy_notices([f"{key}.n=2"]) == [
        f"notice: {key}.do_sample=false validates greedily (verl's agent-loop rollout samples at "
        f"val_kwargs.temperature all the same), so each prompt's {key}.n=2 responses are one response 2 times over "
        f"(best@2, worst@2 and maj@2 equal to mean@2); set {key}.do_sample=true to sample"]
    # sampling at the default temperature, 0, is greedy too
    assert greedy_notices([f"{key}.do_sample=true", f"{key}.n=3"]) == [
        f"notice: {key}.temperature=0.0 validates greedily, so each prompt's {key}.n=3 responses are one response 3 "
        f"times over (best@3, worst@3 and maj@3 equal to mean@3); set {key}.temperature above 0 to sample"]
    # the same said of a file's keys, the section given as one mapping
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    val_kwargs: {temperature: 1.0}\n")
    assert greedy_notices([], path) == [
        f"notice: {key}.temperature=1.0 has no effect: {key}.do_sample=false validates greedily (verl's agent-loop "
        f"rollout samples at val_kwargs.temperature all the same); set {key}.do_sample=true to sample"]
    # nothing to say: sampling at a temperature, one greedy response, the settings at verl's defaults
    assert greedy_notices([f"{key}.do_sample=true", f"{key}.temperature=0.6", f"{key}.n=4"]) == []
    assert greedy_notices([]) == []
    path.write_text("actor_rollout_ref:\n  rollout:\n    val_kwargs: {do_sample: false, temperature: 0, top_p: 1.0, "
                    "top_k: -1, n: 1}\n")
    assert greedy_notices([], path) == []
    assert greedy_notices([f"{key}.top_k=0"]) == []  # 0 is off, as -1


def test_vllm_on_cpu_is_answered_with_an_override_the_command_line_takes():
    """verl's quickstart says rollout.name=vllm; on CPU the refusal's advice, pasted as it is written, runs."""
    message = _errors("actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu")
    [advice] = re.findall(r"use (\S+=hf) on CPU", message)
    assert advice == "actor_rollout_ref.rollout.name=hf"
    cfg = load_config(["actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu", advice], notice=lambda _: None)
    assert cfg.actor_rollout_ref.rollout.name == "hf"
