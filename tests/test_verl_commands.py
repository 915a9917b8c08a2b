"""What a verl user brings over: the environment and command-line settings of verl's own runs, taken or named."""

from __future__ import annotations

import json

import pytest

from rlhf_core.training.tracking import Tracking


@pytest.mark.parametrize("variable", ["VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT"])
def test_verls_file_logger_variables_are_named_with_where_the_records_go(tmp_path, monkeypatch, capsys, variable):
    # verl's file logger writes to $VERL_FILE_LOGGER_PATH (else $VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl);
    # here the records stay in <default_local_dir>/metrics.jsonl, and a verl user looking there is told so
    elsewhere = tmp_path / "verl_logs" / ("metrics.jsonl" if variable.endswith("PATH") else "")
    monkeypatch.setenv(variable, str(elsewhere))
    local_dir = tmp_path / "run"
    with Tracking(["file"], "verl_examples", "gsm8k", local_dir) as tracking:
        tracking.log({"actor/pg_loss": 0.5}, step=1)
    err = capsys.readouterr().err
    assert f"notice: {variable}={elsewhere} (verl's file logger) is not read here" in err
    assert f"writes {local_dir / 'metrics.jsonl'}" in err
    assert [json.loads(line) for line in (local_dir / "metrics.jsonl").read_text().splitlines()] == \
        [{"step": 1, "actor/pg_loss": 0.5}]
    assert not (tmp_path / "verl_logs").exists()


def test_no_notice_without_verls_variables(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    with Tracking(["file"], "verl_examples", "gsm8k", tmp_path) as tracking:
        tracking.log({"actor/pg_loss": 0.5}, step=1)
    assert "VERL_FILE_LOGGER" not in capsys.readouterr().err


def test_a_verl_command_with_hydras_run_folder_trains_and_writes_verls_names(workspace, tmp_path, monkeypatch, capsys):
    # a verl command as verl users write it: Hydra's run folder on the command line, verl's file-logger variable,
    # verl's logger list in Hydra's quoting and +key for a key verl's older tree lacks
    from rlhf_core.cli.train import ppo

    out = tmp_path / "ckpt"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "verl_metrics.jsonl"))
    status = ppo(workspace.overrides(out, f"hydra.run.dir={tmp_path / 'hydra'}", "+trainer.val_before_train=False",
                                     "trainer.logger=['console','file']", "trainer.total_training_steps=1",
                                     "trainer.save_freq=1", "trainer.test_freq=1"))
    err = capsys.readouterr().err
    assert status == 0, err
    assert f"notice: hydra.run.dir={tmp_path / 'hydra'} is Hydra's own setting" in err
    assert "notice: VERL_FILE_LOGGER_PATH=" in err
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["step"] == 1
    assert {"actor/pg_loss", "critic/vf_loss", "response_length/mean", "timing_s/gen"} <= set(record)
    assert any(key.startswith("val-core/") for key in record)
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (out / "global_step_1" / "actor").is_dir() and (out / "global_step_1" / "critic").is_dir()
    assert not (tmp_path / "hydra").exists() and not (tmp_path / "verl_metrics.jsonl").exists()


@pytest.mark.parametrize(("given", "taken"), [
    ("trainer.logger=['console','tracking']", ["console", "wandb"]),
    ("trainer.logger=tracking", ["wandb"]),
    ("trainer.logger=[tracking,wandb]", ["wandb"]),  # (wandb once, not two runs of it)
])
def test_verls_deprecated_tracking_logger_is_taken_as_wandb(given, taken):
    # verl's older examples log with 'tracking', the name its Tracking class gave wandb before the rename
    from rlhf_core.config import load_config

    said = []
    assert list(load_config([given], notice=said.append).trainer.logger) == taken
    assert said == ["notice: trainer.logger: 'tracking' is verl's deprecated name of 'wandb', taken as wandb"]


@pytest.mark.parametrize(("overrides", "written", "taken"), [
    (["trainer.logger=${oc.env:RUN_LOGGER}"], None, ["wandb"]),
    (["trainer.logger=[console,'${oc.env:RUN_LOGGER}']"], None, ["console", "wandb"]),
    ([], "trainer:\n  logger: ${oc.env:RUN_LOGGER}\n", ["wandb"]),
    # a key beside it (the list item's ${..key} is trainer's), whose value is the word
    ([], "trainer:\n  project_name: tracking\n  logger: ${..project_name}\n", ["wandb"]),
    (["trainer.logger=[wandb,'${oc.env:RUN_LOGGER}']"], None, ["wandb"]),  # (wandb once)
    # the word written beside the same word through ${...}: taken as wandb, and said once (it was said twice)
    (["trainer.logger=[tracking,'${oc.env:RUN_LOGGER}']"], None, ["wandb"]),
    ([], "trainer:\n  logger: [console, tracking, '${oc.env:RUN_LOGGER}']\n", ["console", "wandb"]),
])
def test_verls_tracking_logger_an_interpolation_resolves_to_is_taken_as_wandb(overrides, written, taken, tmp_path,
                                                                              monkeypatch):
    # the written word was taken as wandb, the same word given through ${...} refused as no logger
    from rlhf_core.config import load_config

    monkeypatch.setenv("RUN_LOGGER", "tracking")
    path = None
    if written is not None:
        path = tmp_path / "run.yaml"
        path.write_text(written)
    said = []
    assert list(load_config(overrides, config_file=path, notice=said.append).trainer.logger) == taken
    assert said == ["notice: trainer.logger: 'tracking' is verl's deprecated name of 'wandb', taken as wandb"]


def test_verls_deprecated_tracking_logger_in_a_config_file_is_taken_as_wandb(tmp_path):
    from rlhf_core.config import load_config

    (tmp_path / "run.yaml").write_text("trainer:\n  logger: ['console', 'tracking']\n")
    said = []
    assert list(load_config(config_file=tmp_path / "run.yaml", notice=said.append).trainer.logger) == \
        ["console", "wandb"]
    assert said == ["notice: trainer.logger: 'tracking' is verl's deprecated name of 'wandb', taken as wandb"]


# newer verl's reward loop, as its example of a reward model beside the actor writes it (the model served by a
# rollout engine, scored by reward workers): here the model scores in the trainer's workers with its own head
REWARD_LOOP_KEYS = ["reward_model.use_reward_loop=True", "reward_model.num_workers=8", "reward_model.rollout.name=vllm",
                    "reward_model.rollout.gpu_memory_utilization=0.8",
                    "reward_model.rollout.tensor_model_parallel_size=1", "reward_model.rollout.prompt_length=4096",
                    "reward_model.rollout.response_length=4096", "reward_model.reward_loop_source=register"]
ENGINE = "the reward model scores with its classification head in the trainer's workers, not through a rollout engine"
IN_LINE = "rewards are computed after each rollout, a reward model's in the trainer's workers, to the same scores"
NAMED = ("the reward manager is picked by its name, reward_model.reward_manager; a class of your own is not loaded "
         "here: give your scoring as custom_reward_function.path (reward_manager=naive calls it per response, batch "
         "once a batch)")


def test_verls_reward_loop_keys_are_taken_saying_where_the_reward_model_scores():
    # each was an unknown key, with a guess at a key of this trainer's (reward_model.num_workers: "did you mean
    # reward_model.rm_coef?")
    from rlhf_core.config import load_config

    said = []
    assert load_config(REWARD_LOOP_KEYS, notice=said.append) == load_config([], notice=lambda _: None)
    assert said == [
        f"notice: reward_model.use_reward_loop=True has no effect: {IN_LINE}",
        f"notice: reward_model.num_workers=8 has no effect: {IN_LINE}",
        f"notice: reward_model.rollout.name='vllm' has no effect: {ENGINE}",
        f"notice: reward_model.rollout.gpu_memory_utilization=0.8 has no effect: {ENGINE}",
        f"notice: reward_model.rollout.tensor_model_parallel_size=1 has no effect: {ENGINE}",
        f"notice: reward_model.rollout.prompt_length=4096 has no effect: {ENGINE}",
        f"notice: reward_model.rollout.response_length=4096 has no effect: {ENGINE}",
        f"notice: reward_model.reward_loop_source='register' has no effect: {NAMED}",
    ]


def test_verls_reward_loop_keys_in_a_config_file_are_taken(tmp_path):
    from rlhf_core.config import load_config

    (tmp_path / "run.yaml").write_text("reward_model:\n  use_reward_loop: true\n  rollout:\n    name: sglang\n")
    said = []
    assert load_config(config_file=tmp_path / "run.yaml", notice=said.append) == \
        load_config([], notice=lambda _: None)
    assert said == [f"notice: reward_model.use_reward_loop=True has no effect: {IN_LINE}",
                    f"notice: reward_model.rollout.name='sglang' has no effect: {ENGINE}"]


def test_verls_reward_manager_class_of_ones_own_is_refused_naming_custom_reward_function():
    from rlhf_core.config import ConfigError, load_config

    with pytest.raises(ConfigError) as refused:
        load_config(["reward_model.reward_loop_source=importlib", "reward_model.reward_loop_module_path=my_rm.py",
                     "reward_model.reward_loop_class_name=MyManager"], notice=lambda _: None)
    assert str(refused.value).splitlines()[1:] == [
        f"  - reward_model.reward_loop_source='importlib' is not supported: {NAMED}",
        f"  - reward_model.reward_loop_module_path='my_rm.py' is not supported: {NAMED}",
        f"  - reward_model.reward_loop_class_name='MyManager' is not supported: {NAMED}",
    ]


@pytest.fixture(scope="module")
def reward_model_dir(workspace, tmp_path_factory):
    """A random one-label sequence-classification model on the workspace's architecture and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path_factory.mktemp("verl_rm")
    config = AutoConfig.from_pretrained(workspace.model, num_labels=1)
    config.pad_token_id = AutoTokenizer.from_pretrained(workspace.model).pad_token_id
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(workspace.model).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("newest", [False, True])
def test_verls_reward_loop_command_trains_against_its_reward_model(workspace, reward_model_dir, tmp_path, capsys,
                                                                   newest):
    # verl's example of a reward model colocated with the actor, sizes made tiny, in the spelling of the verl
    # releases with the reward loop and in newest verl's (its reward section): both were refused before any step
    from rlhf_core.cli.train import ppo

    if newest:
        reward = ["reward.reward_model.enable=True", f"reward.reward_model.model_path={reward_model_dir}",
                  "reward.reward_model.rollout.name=vllm", "reward.num_workers=8"]
    else:
        reward = ["reward_model.enable=True", f"reward_model.model.path={reward_model_dir}", *REWARD_LOOP_KEYS]
    out = tmp_path / "ckpt"
    status = ppo(workspace.overrides(out, *reward, "trainer.total_training_steps=1", "trainer.test_freq=-1"))
    err = capsys.readouterr().err
    assert status == 0, err
    assert f"notice: reward_model.rollout.name='vllm' has no effect: {ENGINE}" in err
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["step"] == 1
    # the score trained on is the reward model's (verl's rm alone: reward_model.rule_coef=0)
    assert record["critic/score/mean"] == pytest.approx(record["critic/rm_score/mean"], abs=1e-6)


def test_newest_verls_reward_section_is_taken_as_the_keys_it_stands_for():
    # newest verl moves reward_model.*, custom_reward_function.* and the DAPO recipe's reward_kwargs into one
    # section, reward: each was an unknown key (reward.num_workers without a guess)
    from rlhf_core.config import load_config

    said = []
    cfg = load_config(["reward.reward_model.enable=True", "reward.reward_model.model_path=/models/rm",
                       "reward.custom_reward_function.path=/rewards/mine.py",
                       "+reward.custom_reward_function.reward_kwargs.scale=2", "reward.reward_manager.name=dapo",
                       "data.max_response_length=16", "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                       "+reward.reward_kwargs.overlong_buffer_cfg.len=4", "reward.num_workers=4"],
                      notice=said.append, validate=False)
    assert cfg.reward_model.enable is True and cfg.reward_model.model.path == "/models/rm"
    assert cfg.custom_reward_function.path == "/rewards/mine.py"
    assert dict(cfg.custom_reward_function.reward_kwargs) == {"scale": 2}
    assert cfg.reward_model.reward_manager == "dapo"
    assert (cfg.reward_model.overlong_buffer.enable, cfg.reward_model.overlong_buffer.len) == (True, 4)
    newer = "is newer verl's name of"
    assert said == [
        f"notice: reward.reward_model.enable {newer} reward_model.enable, taken as it",
        f"notice: reward.reward_model.model_path {newer} reward_model.model.path, taken as it",
        f"notice: reward.custom_reward_function.path {newer} custom_reward_function.path, taken as it",
        f"notice: reward.custom_reward_function.reward_kwargs.scale {newer} "
        "custom_reward_function.reward_kwargs.scale, taken as it",
        f"notice: reward.reward_manager.name {newer} reward_model.reward_manager, taken as it",
        f"notice: reward.reward_kwargs.overlong_buffer_cfg.enable {newer} "
        "reward_model.reward_kwargs.overlong_buffer_cfg.enable, taken as it",
        f"notice: reward.reward_kwargs.overlong_buffer_cfg.len {newer} "
        "reward_model.reward_kwargs.overlong_buffer_cfg.len, taken as it",
        f"notice: reward.num_workers {newer} reward_model.num_workers, taken as it",
        f"notice: reward_model.num_workers=4 has no effect: {IN_LINE}",
    ]


def test_newest_verls_reward_section_in_a_config_file_is_taken(tmp_path):
    from rlhf_core.config import load_config

    (tmp_path / "run.yaml").write_text("reward:\n  reward_model:\n    enable: true\n    model_path: /models/rm\n"
                                       "  custom_reward_function:\n    path: /rewards/mine.py\n"
                                       "    reward_kwargs: {scale: 2}\n")
    cfg = load_config(config_file=tmp_path / "run.yaml", notice=lambda _: None, validate=False)
    assert cfg.reward_model.enable is True and cfg.reward_model.model.path == "/models/rm"
    assert cfg.custom_reward_function.path == "/rewards/mine.py"
    assert dict(cfg.custom_reward_function.reward_kwargs) == {"scale": 2}


def test_newest_verls_reward_manager_class_is_refused_as_its_older_key_is():
    from rlhf_core.config import ConfigError, load_config

    with pytest.raises(ConfigError) as refused:
        load_config(["reward.reward_manager.source=importlib"], notice=lambda _: None)
    assert str(refused.value).splitlines()[1:] == [
        f"  - reward_model.reward_loop_source='importlib' is not supported: {NAMED}"]


@pytest.mark.parametrize(("override", "valid"), [
    # verl's values that name no near value here: each was answered with a guess at one (npu: "did you mean cpu?",
    # trtllm: "did you mean vllm?", gdpo: "did you mean grpo?")
    ("trainer.device=npu", "cpu, cuda"),
    ("actor_rollout_ref.rollout.name=trtllm", "hf, vllm"),
    ("algorithm.adv_estimator=gdpo", "gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, "
                                     "grpo_passk"),
])
def test_verls_values_not_implemented_here_are_refused_as_verls(override, valid):
    from rlhf_core.config import ConfigError, load_config

    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as refused:
        load_config([override], notice=lambda _: None)
    assert str(refused.value).splitlines()[1:] == [f"  - {key}={value!r} (verl's) is not implemented here: one of {valid}"]


@pytest.mark.parametrize("written", ["command line", "file"])
def test_newest_and_older_verls_spellings_of_one_reward_key_that_differ_are_refused(written, tmp_path):
    # the one written last won without a word, as both were read as the same key
    from rlhf_core.config import ConfigError, load_config

    overrides, path = ["reward_model.model.path=/models/a", "reward.reward_model.model_path=/models/b"], None
    if written == "file":
        path = tmp_path / "run.yaml"
        path.write_text("reward_model:\n  model:\n    path: /models/a\nreward:\n  reward_model:\n"
                        "    model_path: /models/b\n")
        overrides = []
    with pytest.raises(ConfigError) as refused:
        load_config(overrides, config_file=path, notice=lambda _: None)
    assert ("reward.reward_model.model_path='/models/b' and reward_model.model.path='/models/a' both set "
            "reward_model.model.path (verl's spellings of one key): keep one") in str(refused.value)


POLICY_DTYPE = "actor_rollout_ref.actor.fsdp_config.model_dtype"
REF_DTYPE = "actor_rollout_ref.ref.fsdp_config.model_dtype"
CRITIC_DTYPE = "critic.model.fsdp_config.model_dtype"


@pytest.mark.parametrize(("given", "dtype"), [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"),
                                              ("bfloat16", "bfloat16")])
def test_verls_model_dtype_sets_the_dtype_of_the_policys_weights(given, dtype):
    # verl loads the actor's (and the reference's) weights in fsdp_config.model_dtype, which its LoRA recipes set to
    # bf16 for both: refused before as "not supported: weights are kept in float32", while model.dtype keeps them so
    from rlhf_core.config import load_config

    said = []
    cfg = load_config([f"{POLICY_DTYPE}={given}", f"{REF_DTYPE}={given}"], notice=said.append)
    assert cfg.actor_rollout_ref.model.dtype == dtype
    assert said == [
        f"notice: {POLICY_DTYPE}={given!r} is taken as actor_rollout_ref.model.dtype={dtype}, the dtype the policy's "
        "weights are loaded and trained in here",
        f"notice: {REF_DTYPE}={given!r} is taken: the reference is a copy of the policy's weights, kept in "
        f"actor_rollout_ref.model.dtype ({dtype})"]


def test_verls_model_dtype_that_disagrees_with_model_dtype_is_refused_naming_both():
    # model.dtype=bfloat16 with verl's fp32 loaded bfloat16 weights, with a notice that they were kept in float32
    from rlhf_core.config import ConfigError, load_config

    with pytest.raises(ConfigError) as refused:
        load_config(["actor_rollout_ref.model.dtype=bfloat16", f"{POLICY_DTYPE}=fp32"], notice=lambda _: None)
    assert refused.value.errors == [
        f"{POLICY_DTYPE}='float32' and actor_rollout_ref.model.dtype='bfloat16' both set actor_rollout_ref.model.dtype "
        "(verl's spellings of one key): keep one"]
    # the two agreeing, each in its own spelling: taken
    assert load_config(["actor_rollout_ref.model.dtype=bfloat16", f"{POLICY_DTYPE}=bf16"],
                       notice=lambda _: None).actor_rollout_ref.model.dtype == "bfloat16"
    # deleted with ~: the weights back at the default, float32
    assert load_config([f"{POLICY_DTYPE}=bf16", f"~{POLICY_DTYPE}"],
                       notice=lambda _: None).actor_rollout_ref.model.dtype == "float32"
    with pytest.raises(ConfigError) as refused:
        load_config([f"{POLICY_DTYPE}=fp8"], notice=lambda _: None)
    assert refused.value.errors == [
        f"{POLICY_DTYPE}='fp8' is not one of fp32, bf16, fp16, float32, bfloat16, float16"]


def test_the_references_and_the_critics_model_dtype_are_said_to_follow_the_policys():
    # the reference is a copy of the policy's weights (make_reference) and the critic is loaded in the policy's dtype
    # (build_critic): verl's reference alone in bf16 leaves the policy, and so the reference, in float32
    from rlhf_core.config import ConfigError, load_config

    said = []
    cfg = load_config([f"{REF_DTYPE}=bf16", f"{CRITIC_DTYPE}=fp32"], notice=said.append)
    assert cfg.actor_rollout_ref.model.dtype == "float32"
    assert said == [
        f"notice: {REF_DTYPE}='bf16' has no effect: the reference is a copy of the policy's weights, kept in "
        "actor_rollout_ref.model.dtype (float32)",
        f"notice: {CRITIC_DTYPE}='fp32' is taken: the critic is loaded in the policy's dtype, "
        "actor_rollout_ref.model.dtype (float32)"]
    # a critic asked for in float32 beside bfloat16 weights would train in bfloat16
    with pytest.raises(ConfigError) as refused:
        load_config([f"{POLICY_DTYPE}=bf16", f"{CRITIC_DTYPE}=fp32"], notice=lambda _: None)
    assert refused.value.errors == [
        f"{CRITIC_DTYPE}='fp32' is not supported: the critic is loaded in the policy's dtype, "
        "actor_rollout_ref.model.dtype (bfloat16); leave it out, or set actor_rollout_ref.model.dtype=float32 for "
        "both"]


LORA_MERGED = ("the vLLM rollout is given the policy's weights with the LoRA adapters merged in (W + (alpha / r) B A) "
               "after each update, never the adapters apart; the hf rollout generates with the policy itself")
FROM_LOGITS = ("log-probs are computed from the model's logits, or through the LM head in chunks with "
               "model.use_fused_kernels")


@pytest.mark.parametrize(("override", "said"), [
    # newer verl's place of the weight-sync bucket size (its examples set it there)
    ("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
     "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096 has no effect: not passed to "
     "vLLM here, which runs with its own default for it"),
    # verl's LoRA recipes
    ("+actor_rollout_ref.model.lora.merge=True", f"actor_rollout_ref.model.lora.merge=True has no effect: {LORA_MERGED}"),
    ("+actor_rollout_ref.model.lora.merge=False",
     f"actor_rollout_ref.model.lora.merge=False has no effect: {LORA_MERGED}"),
    # verl's older ppo_trainer.yaml, at its values
    ("actor_rollout_ref.rollout.use_fire_sampling=False",
     "actor_rollout_ref.rollout.use_fire_sampling=False has no effect: every response token is sampled at "
     "rollout.temperature (FIRE's hotter first token is not done here)"),
    ("actor_rollout_ref.rollout.chat_scheduler=null",
     "actor_rollout_ref.rollout.chat_scheduler=None has no effect: rollouts run in the trainer's workers, one batch "
     "at a time, without verl's chat scheduler"),
    ("actor_rollout_ref.model.use_fused_loss=False",
     f"actor_rollout_ref.model.use_fused_loss=False has no effect: {FROM_LOGITS}"),
    ("actor_rollout_ref.model.return_last_hidden_state=False",
     f"actor_rollout_ref.model.return_last_hidden_state=False has no effect: {FROM_LOGITS}"),
])
def test_keys_of_verls_examples_and_older_tree_are_taken_saying_what_is_done(override, said):
    # each was an unknown key, with a guess at another (update_weights_bucket_megabytes: "did you mean
    # actor_rollout_ref.rollout.free_cache_engine?")
    from rlhf_core.config import load_config

    notices = []
    assert load_config([override], notice=notices.append) == load_config([], notice=lambda _: None)
    assert notices == [f"notice: {said}"]


@pytest.mark.parametrize("override", ["actor_rollout_ref.rollout.use_fire_sampling=True",
                                      "actor_rollout_ref.rollout.chat_scheduler=verl.schedulers.Naive",
                                      "actor_rollout_ref.model.use_fused_loss=True"])
def test_verls_older_switches_asking_for_what_is_not_here_are_refused(override):
    from rlhf_core.config import ConfigError, load_config

    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as refused:
        load_config([override], notice=lambda _: None)
    [error] = refused.value.errors
    assert error.startswith(f"{key}={True if value == 'True' else value!r} is not supported: "), error


UNREAD_BY_HF = ("has no effect: it is read by the vLLM rollout only (actor_rollout_ref.rollout.name=vllm; GPU), and "
                "actor_rollout_ref.rollout.name=hf generates with transformers' generate")
# the rollout keys rollout/vllm.py alone reads, each away from its default
VLLM_ONLY = {"dtype": "float32", "tensor_model_parallel_size": 4, "gpu_memory_utilization": 0.4,
             "free_cache_engine": False, "enforce_eager": False, "max_num_batched_tokens": 4096,
             "enable_chunked_prefill": False}


@pytest.mark.parametrize(("name", "value"), VLLM_ONLY.items())
def test_vllm_settings_under_the_hf_rollout_are_said_to_be_unread(name, value):
    # verl's rollout is vLLM: its commands' engine settings ran transformers' generate here without a word
    from rlhf_core.config import load_config

    key = f"actor_rollout_ref.rollout.{name}"
    said = []
    load_config([f"{key}={value}"], notice=said.append)
    assert said == [f"notice: {key}={value!r} {UNREAD_BY_HF}"]


def test_vllm_settings_are_unread_only_under_hf_and_away_from_their_defaults(repo_root):
    from rlhf_core.config import load_config

    verl_command = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=4"]
    said = []
    load_config(verl_command, notice=said.append)
    assert sorted(said) == [f"notice: actor_rollout_ref.rollout.gpu_memory_utilization=0.4 {UNREAD_BY_HF}",
                            f"notice: actor_rollout_ref.rollout.tensor_model_parallel_size=4 {UNREAD_BY_HF}"]
    said = []  # the vLLM rollout reads them (8 workers on cuda by default: 4 divides them)
    load_config([*verl_command, "actor_rollout_ref.rollout.name=vllm"], notice=said.append)
    assert said == []
    # at their defaults, as the defaults file spells every key: nothing to say
    load_config(["actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "actor_rollout_ref.rollout.dtype=bfloat16"],
                notice=said.append)
    load_config(config_file=repo_root / "configs" / "ppo_trainer.yaml", notice=said.append)
    assert said == []
