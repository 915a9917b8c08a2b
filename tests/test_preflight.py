"""The preflight's length budget against every model that reads the rollout's sequences: the critic's positions
(with GAE) and the reward model's, read from config files alone (the weights here are garbage bytes, never loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import PreflightError, preflight, trained_reward_model_problems
from rlhf_core.models.toy import random_toy_model

# data.max_prompt_length + data.max_response_length below: 200 + 56
BUDGET = 256
OTHER_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}### Q: {{ message['content'] }}\n"
                  "{% else %}### A: {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> Path:
    """The root of a 512-position toy actor (``actor``) and synthetic prompts (``data``)."""
    root = tmp_path_factory.mktemp("preflight")
    random_toy_model(root / "actor", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    build_dataset(root / "data", n_train=8, n_test=4, seed=0, max_ops=1)
    return root


def _weights_and_tokenizer(base: Path, target: Path, template: str | None = None) -> None:
    """Weights that are not the model's (a whole safetensors file holding one stray head: the preflight reads
    headers, never the weights) and ``base``'s tokenizer, its chat template replaced where ``template`` is
    given."""
    save_file({"score.weight": torch.zeros(1)}, target / "model.safetensors")
    tokenizer = AutoTokenizer.from_pretrained(base)
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(target)


def causal_model(base: Path, target: Path, positions: int) -> Path:
    """``base``'s causal LM with ``positions`` position embeddings."""
    target.mkdir()
    config = json.loads((base / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    _weights_and_tokenizer(base, target)
    return target


def reward_model(base: Path, target: Path, positions: int, template: str | None = None) -> Path:
    """A one-label sequence-classification model on ``base``'s architecture with ``positions`` positions."""
    config = AutoConfig.from_pretrained(base, num_labels=1, max_position_embeddings=positions)
    config.architectures = ["LlamaForSequenceClassification"]
    config.pad_token_id = AutoTokenizer.from_pretrained(base).pad_token_id
    config.save_pretrained(target)
    _weights_and_tokenizer(base, target, template)
    return target


LLAMA_TARGETS = ("set model.target_modules to some of its linear layers, "
                 "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj], or all-linear")


def _config(root: Path, *extra: str, actor: Path | None = None):
    return load_config([f"actor_rollout_ref.model.path={actor or root / 'actor'}",
                        f"data.train_files={root / 'data' / 'train.parquet'}",
                        f"data.val_files={root / 'data' / 'test.parquet'}", "data.train_batch_size=4",
                        "data.max_prompt_length=200", "data.max_response_length=56",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.device=cpu",
                        "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={root / 'out'}", *extra])


def _errors(cfg) -> list[str]:
    with pytest.raises(PreflightError) as error:
        preflight(cfg)
    return error.value.errors


def test_the_fixture_passes(space):
    preflight(_config(space))  # the 512-position actor, its critic (the same model) and no reward model


def test_a_critic_with_fewer_positions_than_the_budget_is_a_preflight_error(space, tmp_path):
    critic = causal_model(space / "actor", tmp_path / "critic", BUDGET - 1)
    assert _errors(_config(space, f"critic.model.path={critic}")) == [
        f"critic.model.path: {critic} has max_position_embeddings 255 but the critic reads prompt + response "
        "sequences of up to data.max_prompt_length + data.max_response_length = 256 tokens; use a critic with at "
        "least 256 positions, or lower data.max_response_length or data.max_prompt_length"]
    # without a critic (GRPO) its positions do not matter
    preflight(_config(space, f"critic.model.path={critic}", "algorithm.adv_estimator=grpo",
                      "actor_rollout_ref.rollout.n=2"))


def test_a_critic_with_exactly_the_budget_passes(space, tmp_path):
    preflight(_config(space, f"critic.model.path={causal_model(space / 'actor', tmp_path / 'critic', BUDGET)}"))


def test_a_critic_that_is_the_actors_model_is_reported_once(space, tmp_path):
    actor = causal_model(space / "actor", tmp_path / "short", 128)
    actor_message = ("data.max_prompt_length + data.max_response_length = 256 exceeds the model's "
                     "max_position_embeddings (128); lower data.max_response_length or data.max_prompt_length")
    assert _errors(_config(space, actor=actor)) == [actor_message]  # critic.model.path null: the actor's
    assert _errors(_config(space, f"critic.model.path={actor}", actor=actor)) == [actor_message]  # named the same
    assert _errors(_config(space, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                           actor=actor)) == [actor_message]


def test_a_critic_override_that_shortens_the_actors_model_is_reported(space):
    errors = _errors(_config(space, "critic.model.override_config={max_position_embeddings: 200}"))
    assert errors == [
        f"critic.model.path with critic.model.override_config: {space / 'actor'} has max_position_embeddings 200 "
        "but the critic reads prompt + response sequences of up to data.max_prompt_length + "
        "data.max_response_length = 256 tokens; use a critic with at least 256 positions, or lower "
        "data.max_response_length or data.max_prompt_length"]
    preflight(_config(space, "critic.model.override_config={max_position_embeddings: 256}"))


def test_a_reward_model_with_fewer_positions_than_the_budget_is_a_preflight_error(space, tmp_path):
    rm = reward_model(space / "actor", tmp_path / "rm", BUDGET - 1)
    enabled = ("reward_model.enable=true", f"reward_model.model.path={rm}")
    assert _errors(_config(space, *enabled)) == [
        f"reward_model.model.path: {rm} has max_position_embeddings 255 but the reward model scores the policy's "
        "prompt + response ids as they are, uncut: up to data.max_prompt_length + data.max_response_length = 256 "
        "tokens; use a reward model with at least 256 positions, or lower data.max_response_length or "
        "data.max_prompt_length"]
    preflight(_config(space, *enabled, "data.max_response_length=55"))  # 255 tokens fit
    # the policy's ids are never cut: a max_length below the budget would not be applied, so it is refused
    assert _errors(_config(space, *enabled, "data.max_response_length=55", "reward_model.max_length=200")) == [
        "reward_model.max_length=200 cuts only sequences the reward model re-encodes, and "
        f"{rm} scores the policy's ids as they are (same tokenizer and chat template), up to "
        "data.max_prompt_length + data.max_response_length = 255 tokens, uncut; remove the key, or "
        "lower data.max_response_length or data.max_prompt_length"]
    preflight(_config(space, *enabled, "data.max_response_length=55", "reward_model.max_length=255"))
    preflight(_config(space, "reward_model.enable=true",
                      f"reward_model.model.path={reward_model(space / 'actor', tmp_path / 'rm_ok', BUDGET)}"))


def test_a_reward_model_that_re_encodes_says_what_it_scores(space, tmp_path):
    rm = reward_model(space / "actor", tmp_path / "rm", 128, template=OTHER_TEMPLATE)
    errors = _errors(_config(space, "reward_model.enable=true", f"reward_model.model.path={rm}",
                             "data.return_raw_chat=true"))
    assert errors == [
        f"reward_model.model.path: {rm} has max_position_embeddings 128 but the reward model re-encodes each "
        "conversation with its own chat template: the whole prompt (data.truncation does not shorten it) "
        "plus the response re-tokenized and EOS, about data.max_prompt_length + data.max_response_length = 256 "
        "tokens, more where its tokenizer splits text finer; use a reward model with at least 256 positions, or set "
        "reward_model.max_length (at most 128) to cut longer ones from the left, or lower data.max_response_length "
        "or data.max_prompt_length"]
    # a cut chosen: passes; one past the model's positions: refused
    preflight(_config(space, "reward_model.enable=true", f"reward_model.model.path={rm}", "data.return_raw_chat=true",
                      "reward_model.max_length=128"))
    assert _errors(_config(space, "reward_model.enable=true", f"reward_model.model.path={rm}",
                           "data.return_raw_chat=true", "reward_model.max_length=129")) == [
        f"reward_model.max_length=129 exceeds the max_position_embeddings of {rm} (128)"]
    # without the raw messages both problems are listed
    errors = _errors(_config(space, "reward_model.enable=true", f"reward_model.model.path={rm}"))
    assert [e.split(" ", 2)[1] for e in errors] == ["the", f"{rm}"]
    assert "set data.return_raw_chat=true" in errors[0] and "max_position_embeddings 128" in errors[1]


def test_a_reward_model_still_to_be_trained_is_checked_from_its_base(space, tmp_path):
    """The rlhf_rm pipeline's first step: the reward model it trains from reward_model.train keeps its base's
    tokenizer, chat template and positions, so what would stop PPO against it is known before it trains (the
    smoke test found it after training, and named the artifact's temporary folder instead of the base)."""
    base = causal_model(space / "actor", tmp_path / "base", 128)
    _weights_and_tokenizer(space / "actor", base, OTHER_TEMPLATE)
    trained = f"reward_model.train.model.path={base}"
    assert trained_reward_model_problems(_config(space, trained)) == [
        f"reward_model.train.model.path: the tokenizer or chat template of {base} (which the reward model trained "
        f"from it keeps) differs from reward_model.model.input_tokenizer ({space / 'actor'}), so responses are "
        "re-encoded from the chat messages: set data.return_raw_chat=true (or input_tokenizer=null to feed the "
        "policy's ids as they are)",
        f"reward_model.train.model.path: the reward model trained from {base} has max_position_embeddings 128 but "
        "the reward model re-encodes each conversation with its own chat template: the whole prompt "
        "(data.truncation does not shorten it) plus the response re-tokenized and EOS, about data.max_prompt_length "
        "+ data.max_response_length = 256 tokens, more where its tokenizer splits text finer; use a reward model "
        "with at least 256 positions, or set reward_model.max_length (at most 128) to cut longer ones from the "
        "left, or lower data.max_response_length or data.max_prompt_length"]
    assert trained_reward_model_problems(_config(space, trained, "data.return_raw_chat=true",
                                                 "reward_model.max_length=128")) == []
    # the tokenizer from reward_model.train.model.tokenizer_path: named by that key; the policy's own passes
    same = causal_model(space / "actor", tmp_path / "same", BUDGET)
    errors = trained_reward_model_problems(_config(space, f"reward_model.train.model.path={same}",
                                                   f"reward_model.train.model.tokenizer_path={base}"))
    assert errors == [f"reward_model.train.model.tokenizer_path: the tokenizer or chat template of {base} (which "
                      f"the reward model trained from it keeps) differs from reward_model.model.input_tokenizer "
                      f"({space / 'actor'}), so responses are re-encoded from the chat messages: set "
                      "data.return_raw_chat=true (or input_tokenizer=null to feed the policy's ids as they are)"]
    assert trained_reward_model_problems(_config(space, f"reward_model.train.model.path={same}")) == []
    missing = trained_reward_model_problems(_config(space, f"reward_model.train.model.path={tmp_path / 'none'}"))
    assert [e.startswith(f"reward_model.train.model.path: {tmp_path / 'none'} is not a directory") for e in missing] \
        == [True]


def test_a_critic_without_the_actors_override_is_told_to_take_it(space, tmp_path):
    """A 128-position actor that reaches 256 through its override_config: the critic (its model, null path) does
    not take the actor's override, so the remedy names the critic's own."""
    actor = causal_model(space / "actor", tmp_path / "short", 128)
    errors = _errors(_config(space, "+actor_rollout_ref.model.override_config.max_position_embeddings=256",
                             actor=actor))
    assert errors == [
        f"critic.model.path: {actor} has max_position_embeddings 128 but the critic reads prompt + response "
        "sequences of up to data.max_prompt_length + data.max_response_length = 256 tokens; the actor reaches "
        "further through actor_rollout_ref.model.override_config, which the critic does not take: give it the same "
        "in critic.model.override_config, or lower data.max_response_length or data.max_prompt_length"]
    preflight(_config(space, "+actor_rollout_ref.model.override_config.max_position_embeddings=256",
                      "+critic.model.override_config.max_position_embeddings=256", actor=actor))
    # an actor override that does not reach the budget either: the plain advice, beside the actor's own error
    errors = _errors(_config(space, "+actor_rollout_ref.model.override_config.max_position_embeddings=200",
                             actor=actor))
    assert len(errors) == 2 and "exceeds the model's max_position_embeddings (200)" in errors[0]
    assert "use a critic with at least 256 positions" in errors[1]


def _prompts_alone(space, folder: Path, source: str, graded_rows: int = 0) -> Path:
    """The synthetic prompts under another data source, a ground truth kept on the first ``graded_rows`` only."""
    import pandas as pd

    folder.mkdir()
    for split in ("train", "test"):
        frame = pd.read_parquet(space / "data" / f"{split}.parquet")
        frame["data_source"] = source
        frame["reward_model"] = [value if i < graded_rows else {"style": "model", "ground_truth": None}
                                 for i, value in enumerate(frame["reward_model"])]
        frame.to_parquet(folder / f"{split}.parquet")
    return folder


def test_prompts_alone_from_a_source_without_a_rule_pass_against_a_reward_model(space, tmp_path):
    rm = reward_model(space / "actor", tmp_path / "rm", 512)
    data = _prompts_alone(space, tmp_path / "hh", "hh_rlhf")
    files = (f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}")
    preflight(_config(space, *files, "reward_model.enable=true", f"reward_model.model.path={rm}"))
    # a rule share in the reward grades every row: the source needs a rule
    errors = _errors(_config(space, *files, "reward_model.enable=true", f"reward_model.model.path={rm}",
                             "reward_model.rule_coef=0.5"))
    assert [e.split(":")[0] for e in errors] == ["data.train_files"] * 2 + ["data.val_files"] * 2
    assert errors[0].startswith("data.train_files: 8 rows have no reward_model.ground_truth (the built-in rule")
    assert errors[1].startswith("data.train_files: no reward function for data_source hh_rlhf")
    # a row that has a ground truth is graded by the rule, so its source needs one even with rule_coef=0
    mixed = _prompts_alone(space, tmp_path / "mixed", "hh_rlhf", graded_rows=1)
    errors = _errors(_config(space, f"data.train_files={mixed / 'train.parquet'}", "data.val_files=[]",
                             "reward_model.enable=true", f"reward_model.model.path={rm}"))
    assert errors == ["data.train_files: no reward function for data_source hh_rlhf (known: openai/gsm8k, "
                      "synthetic/arithmetic); set custom_reward_function.path and .name"]


def test_dynamic_sampling_on_accuracy_is_refused_for_prompts_without_a_ground_truth(space, tmp_path):
    rm = reward_model(space / "actor", tmp_path / "rm", 512)
    data = _prompts_alone(space, tmp_path / "alone", "synthetic/arithmetic", graded_rows=3)
    grpo = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "reward_model.enable=true",
            f"reward_model.model.path={rm}", f"data.train_files={data / 'train.parquet'}", "data.val_files=[]",
            "algorithm.filter_groups.enable=true")
    assert _errors(_config(space, *grpo, "algorithm.filter_groups.metric=acc")) == [
        "data.train_files: 5 rows have no reward_model.ground_truth, so no accuracy: algorithm.filter_groups.metric="
        "acc cannot group them; use seq_reward or score"]
    preflight(_config(space, *grpo, "algorithm.filter_groups.metric=score"))
    # validation prompts without one are not grouped: training data that all have one pass
    graded = _prompts_alone(space, tmp_path / "graded", "synthetic/arithmetic", graded_rows=8)
    preflight(_config(space, *grpo, "algorithm.filter_groups.metric=acc", f"data.train_files={graded / 'train.parquet'}",
                      f"data.val_files={data / 'test.parquet'}"))


def test_a_data_tokenizer_with_another_chat_template_is_refused(space, tmp_path):
    """The data checks measure prompts with data.tokenizer, training renders them with the actor's: the two must
    render alike. The same vocabulary with the same template passes; another template is refused."""
    same, other = tmp_path / "same", tmp_path / "other"
    for folder, template in ((same, None), (other, OTHER_TEMPLATE)):
        folder.mkdir()
        _weights_and_tokenizer(space / "actor", folder, template)
    preflight(_config(space, f"data.tokenizer={same}"))
    assert _errors(_config(space, f"data.tokenizer={other}")) == [
        f"data.tokenizer: {other} has another chat template than actor_rollout_ref.model.path ({space / 'actor'}), "
        "with which training renders the prompts: the data checks would measure other prompts than the trainer "
        "reads; leave data.tokenizer null"]


CUSTOM_ARCH = '''from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


class ToyCustomConfig(LlamaConfig):
    model_type = "toy_custom_preflight"


class ToyCustomForCausalLM(LlamaForCausalLM):
    config_class = ToyCustomConfig


AutoConfig.register("toy_custom_preflight", ToyCustomConfig, exist_ok=True)
AutoModelForCausalLM.register(ToyCustomConfig, ToyCustomForCausalLM, exist_ok=True)
'''


def test_external_lib_registers_an_architecture_before_the_checks_and_a_broken_config_is_named(space, tmp_path,
                                                                                                  monkeypatch):
    """A model of an architecture only its library knows: preflight imports actor_rollout_ref.model.external_lib
    first (as verl's workers do), so its config reads; without it, or with a module that does not import, or with
    a config.json that is not JSON, preflight says so in one line each."""
    (tmp_path / "toy_custom_arch.py").write_text(CUSTOM_ARCH)
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = tmp_path / "custom"
    custom.mkdir()
    config = json.loads((space / "actor" / "config.json").read_text())
    (custom / "config.json").write_text(json.dumps({**config, "model_type": "toy_custom_preflight",
                                                    "architectures": ["ToyCustomForCausalLM"]}))
    _weights_and_tokenizer(space / "actor", custom)
    [error] = _errors(_config(space, actor=custom))
    assert error.startswith(f"actor_rollout_ref.model.path: {custom} cannot be read as a HF model: ")
    preflight(_config(space, "actor_rollout_ref.model.external_lib=toy_custom_arch", actor=custom))
    errors = _errors(_config(space, "actor_rollout_ref.model.external_lib=no_such_module_here"))
    assert errors == ["actor_rollout_ref.model.external_lib: module 'no_such_module_here' cannot be imported "
                      "(No module named 'no_such_module_here'); a module of the current folder imports where the "
                      "folder is on PYTHONPATH (PYTHONPATH=. ...), which the installed commands do not add"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", ')
    _weights_and_tokenizer(space / "actor", broken)
    [error] = _errors(_config(space, actor=broken))
    assert error.startswith(f"actor_rollout_ref.model.path: {broken / 'config.json'} cannot be read as JSON (")


def test_lora_targets_packages_and_the_port_are_checked_before_any_weights_load(space, monkeypatch):
    """A LoRA target naming no module of the model, a logger or rollout engine whose package is not installed,
    and a Prometheus port already taken: each failed only after the weights had loaded."""
    import importlib.util
    import socket

    assert _errors(_config(space, "actor_rollout_ref.model.lora_rank=4",
                           "actor_rollout_ref.model.target_modules=[q_proj,vproj]")) == [
        f"actor_rollout_ref.model.target_modules: vproj names no module of {space / 'actor'} (an entry is a module's "
        f"name or its last parts); {LLAMA_TARGETS}"]
    preflight(_config(space, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"))
    assert "critic.model.target_modules=.*attention: a string is a regular expression" in "\n".join(_errors(_config(
        space, "critic.model.lora_rank=4", "critic.model.target_modules=.*attention")))  # a regex over whole names
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name in ("wandb", "vllm") else real(name, *args))
    errors = _errors(_config(space, "trainer.logger=[console,wandb]"))
    assert errors == ["trainer.logger includes wandb but the wandb package is not installed: install it or leave "
                      "wandb out"]
    errors = _errors(_config(space, "actor_rollout_ref.rollout.name=vllm", "trainer.device=cuda"))
    assert "actor_rollout_ref.rollout.name=vllm but vllm is not installed (pip install -e '.[gpu]' on a CUDA " \
           "machine), or use actor_rollout_ref.rollout.name=hf" in errors
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        [error] = _errors(_config(space, f"trainer.prometheus_port={port}"))
    assert error.startswith(f"trainer.prometheus_port={port}: 127.0.0.1:{port} cannot be served (")


def test_the_port_of_a_run_scraped_a_moment_ago_is_free_and_a_served_one_is_not(space):
    """The exporter's scrapes leave their connections in TIME_WAIT on its port for a minute after the run: the
    preflight's plain bind called the port taken where the exporter itself (SO_REUSEADDR) serves it at once, as
    a quick rerun or a retried step would."""
    import urllib.request

    from rlhf_core.training.monitoring import PrometheusExporter

    with PrometheusExporter(0) as exporter:
        port = exporter.port
        for _ in range(3):
            with urllib.request.urlopen(exporter.url, timeout=10) as page:
                page.read()
        [error] = _errors(_config(space, f"trainer.prometheus_port={port}"))  # served: taken
        assert error.startswith(f"trainer.prometheus_port={port}: 127.0.0.1:{port} cannot be served (")
    preflight(_config(space, f"trainer.prometheus_port={port}"))  # closed, its connections in TIME_WAIT: free
    with PrometheusExporter(port) as again:  # and the exporter does serve it
        assert again.port == port


@pytest.mark.parametrize("uri", ["file:/tmp/mlruns", "/tmp/mlruns", "./mlruns"])
def test_an_mlflow_file_store_without_mlflows_permission_is_refused_before_the_weights_load(space, monkeypatch, uri):
    """MLflow 3 refuses a folder store unless MLFLOW_ALLOW_FILE_STORE is true: it failed after the models loaded,
    with a traceback and exit 1."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert _errors(_config(space, "trainer.logger=[console,mlflow]")) == [
        f"MLFLOW_TRACKING_URI={uri} is a file store, which MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true: set "
        "that, or use a database store (sqlite:///PATH/mlflow.db), or unset MLFLOW_TRACKING_URI for the run's own "
        "SQLite store"]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    preflight(_config(space, "trainer.logger=[console,mlflow]"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/mlflow.db")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    preflight(_config(space, "trainer.logger=[console,mlflow]"))


def tiny_gpt2(base: Path, target: Path) -> Path:
    """A GPT-2 (Conv1D projections, its lm_head tied to the embedding) with ``base``'s tokenizer and vocabulary."""
    from transformers import GPT2Config

    tokenizer = AutoTokenizer.from_pretrained(base)
    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tokenizer), n_positions=BUDGET,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(target)
    _weights_and_tokenizer(base, target)
    return target


def test_lora_on_a_model_without_linear_projections_is_refused_before_any_weights_load(space, tmp_path):
    """GPT-2's projections are Conv1D and its one linear layer, lm_head, is tied to the embedding: LoRA's default
    all-linear adapted the Conv1D layers and failed in apply_lora after the weights had loaded, advising q_proj."""
    gpt2 = tiny_gpt2(space / "actor", tmp_path / "gpt2")
    cannot = "the model has no linear layer LoRA can adapt here: train it in full, lora_rank=0"
    assert _errors(_config(space, "actor_rollout_ref.model.lora_rank=4", "algorithm.adv_estimator=grpo",
                           "actor_rollout_ref.rollout.n=2", actor=gpt2)) == [
        f"actor_rollout_ref.model.target_modules ({gpt2}): LoRA adapters on transformer.h.0.attn.c_attn (Conv1D), "
        "transformer.h.0.attn.c_proj (Conv1D), transformer.h.0.mlp.c_fc (Conv1D), transformer.h.0.mlp.c_proj "
        f"(Conv1D): only adapters of linear layers (torch.nn.Linear) are merged into the rollout's and the export's "
        f"weights; {cannot}"]
    assert _errors(_config(space, "actor_rollout_ref.model.lora_rank=4", "critic.model.lora_rank=4",
                           "critic.model.target_modules=[q_proj]", actor=gpt2))[1:] == [
        f"critic.model.target_modules: q_proj names no module of {gpt2} (an entry is a module's name or its last "
        f"parts); {cannot}"]
    assert _errors(_config(space, "critic.model.lora_rank=4", "critic.model.target_modules=[embed_tokens]")) == [
        f"critic.model.target_modules ({space / 'actor'}): LoRA adapters on model.embed_tokens (Embedding): only "
        "adapters of linear layers (torch.nn.Linear) are merged into the rollout's and the export's weights; "
        f"{LLAMA_TARGETS}"]


def test_lora_on_an_output_head_tied_to_the_embedding_is_refused(space):
    """The toy model ties lm_head to embed_tokens (as SmolLM2 does): the export and vLLM hold one tensor for both,
    so an adapted head was exported as the base model's, silently."""
    assert _errors(_config(space, "actor_rollout_ref.model.lora_rank=4",
                           "actor_rollout_ref.model.target_modules=[q_proj,lm_head]")) == [
        f"actor_rollout_ref.model.target_modules ({space / 'actor'}): LoRA adapters on lm_head, the output head tied "
        "to the input embedding (tie_word_embeddings): the rollout's and the export's weights hold one tensor for "
        "both, the embedding's, so the trained head would be lost there and the base model's used instead; leave "
        f"lm_head out: {LLAMA_TARGETS}"]


def test_a_target_modules_string_is_said_to_be_a_regular_expression(space):
    """peft reads a string as one regular expression over whole module names: q_proj matches none of them, and the
    message advised q_proj."""
    assert _errors(_config(space, "actor_rollout_ref.model.lora_rank=4",
                           "actor_rollout_ref.model.target_modules=q_proj")) == [
        "actor_rollout_ref.model.target_modules=q_proj: a string is a regular expression over whole module names "
        f"(such as model.layers.0.self_attn.q_proj) and matches no module of {space / 'actor'}; for the layers "
        "named q_proj, write the list [q_proj]"]
    preflight(_config(space, "actor_rollout_ref.model.lora_rank=4",
                      "actor_rollout_ref.model.target_modules='.*\\.q_proj'"))


def test_ground_truths_the_rule_never_matches_and_rows_without_a_source_are_named(space, tmp_path):
    """Ground truths no response can earn the rule's score against (a list turned to text, a word, "4.0") trained
    at score 0 without a word; a row without a data_source failed in preflight with pandas' TypeError."""
    import pandas as pd

    frame = pd.read_parquet(space / "data" / "train.parquet")
    frame["reward_model"] = [{"style": "rule", "ground_truth": ["['4']", "four", "4.0"][i] if i < 3 else
                              cell["ground_truth"]} for i, cell in enumerate(frame["reward_model"])]
    frame.loc[5, "data_source"] = None
    path = tmp_path / "train.parquet"
    frame.to_parquet(path)
    errors = _errors(_config(space, f"data.train_files={path}", "data.val_files=[]"))
    assert errors == [
        f"data.train_files: rows without a data_source (the reward is routed by it): {path} row 5",
        f"data.train_files: ground truths a right answer cannot match under the built-in rule reward: {path} row 0: "
        f"\"['4']\" is not a number as answers write them (digits, a leading minus or $, thousands commas, "
        f"decimals: e.g. 0.5, not .5): the rule compares the text after '#### ' with it; {path} row 1: 'four' is "
        f"not a number as answers write them (digits, a leading minus or $, thousands commas, decimals: e.g. 0.5, "
        f"not .5): the rule compares the text after '#### ' with it; {path} row 2: '4.0' is an integer written with a "
        "fraction of zeros: responses answering '#### 4' score 0 (the rule compares strings); store it as '4'"]
    # a custom reward function reads the ground truths its own way
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    errors = _errors(_config(space, f"data.train_files={path}", "data.val_files=[]",
                             f"custom_reward_function.path={reward}"))
    assert errors == [f"data.train_files: rows without a data_source (the reward is routed by it): {path} row 5"]


def test_a_file_of_a_split_without_a_column_the_others_have_is_named(space, tmp_path):
    """A file without 'reward_model' beside one with it was counted as rows without a ground truth ("4 rows have no
    reward_model.ground_truth"), and one without the prompt column passed preflight to fail in the dataset."""
    import pandas as pd

    frame = pd.read_parquet(space / "data" / "test.parquet")
    with_all = space / "data" / "train.parquet"
    no_truth, no_prompt = tmp_path / "no_truth.parquet", tmp_path / "no_prompt.parquet"
    frame.drop(columns=["reward_model"]).to_parquet(no_truth)
    frame.drop(columns=["prompt"]).to_parquet(no_prompt)
    errors = _errors(_config(space, f"data.train_files=[{with_all},{no_truth}]", f"data.val_files=[{no_prompt},"
                                    f"{with_all}]"))
    assert [e.split(". ")[0].split(" (")[0] for e in errors] == [
        f"data.train_files: {no_truth} lacks column 'reward_model', which {with_all} has: add it to that file",
        f"data.val_files: {no_prompt} lacks column 'prompt', which {with_all} has: add it to that file"]
    assert "the built-in rule rewards" in errors[0]
    # prompts alone, as a reward model at rule_coef=0 takes them: only the prompt column is wanted of every file
    rm = reward_model(space / "actor", tmp_path / "rm", 512)
    alone = ("reward_model.enable=true", f"reward_model.model.path={rm}", "reward_model.rule_coef=0")
    assert _errors(_config(space, *alone, f"data.train_files=[{with_all},{no_truth}]",
                           f"data.val_files=[{no_prompt},{with_all}]")) == [errors[1]]
    preflight(_config(space, *alone, f"data.train_files=[{with_all},{no_truth}]", "data.val_files=[]"))


def test_a_float32_ground_truth_field_with_fractions_is_refused(space, tmp_path):
    """pyarrow reads a float32 field back as a double: 2.5 stays 2.5, but 0.1 becomes 0.10000000149011612, which no
    '#### 0.1' matches (it trained at score 0); integers read back whole."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    frame = pd.read_parquet(space / "data" / "train.parquet")
    truths = [0.1, 2.5] + [float(i) for i in range(len(frame) - 2)]
    rule = pa.struct([("style", pa.string()), ("ground_truth", pa.float32())])
    table = pa.Table.from_pandas(frame.drop(columns=["reward_model"]), preserve_index=False).append_column(
        "reward_model", pa.array([{"style": "rule", "ground_truth": t} for t in truths], type=rule))
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    errors = _errors(_config(space, f"data.train_files={path}", "data.val_files=[]"))
    assert errors == [f"data.train_files: ground truths a right answer cannot match under the built-in rule reward: "
                      f"{path} row 0: 0.10000000149011612 is a float32 field's value read back as a double, which no "
                      "answer matches; store the ground truths as text (or float64)"]
    pq.write_table(table.set_column(table.schema.get_field_index("reward_model"), "reward_model", pa.array(
        [{"style": "rule", "ground_truth": float(i)} for i in range(len(truths))], type=rule)), path)
    preflight(_config(space, f"data.train_files={path}", "data.val_files=[]"))  # whole numbers read back whole


def test_a_ray_address_where_nothing_answers_is_refused_at_once(space, monkeypatch):
    """ray.init waited minutes on such an address, printing only Ray's retries; a listener that is not Ray (it
    accepts, and says nothing) is refused as well."""
    import socket

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    two = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
           "critic.ppo_micro_batch_size_per_gpu=2")
    errors = _errors(_config(space, *two, f"trainer.ray_address=127.0.0.1:{port}"))
    assert len(errors) == 1 and errors[0].startswith(
        f"trainer.ray_address (or RAY_ADDRESS) '127.0.0.1:{port}': nothing answers at 127.0.0.1:{port} within 5 s")
    assert errors[0].endswith(f"start the cluster there (ray start --head --port {port}) or fix the address")
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{port}")
    assert "nothing answers" in _errors(_config(space, *two))[0]
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr("rlhf_core.workers.group.RAY_CONNECT_TIMEOUT_S", 1.0)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        errors = _errors(_config(space, *two, f"trainer.ray_address=127.0.0.1:{port}"))
    assert errors == [f"trainer.ray_address (or RAY_ADDRESS) '127.0.0.1:{port}': what answers at 127.0.0.1:{port} "
                      "is not Ray's GCS: it accepts the connection but sends nothing within 1 s; give the head's GCS "
                      "address (ray start --head prints it; port 6379 by default), or a Ray client server's as "
                      "ray://<head>:10001"]
    preflight(_config(space, *two, "trainer.ray_address=auto"))  # Ray's own lookup: left to it
    preflight(_config(space, *two, "trainer.ray_address='::1'"))  # a bare IPv6 address (no port): left to Ray
    errors = _errors(_config(space, *two, "trainer.ray_address=no-such-host.invalid:6379"))
    assert errors[0].startswith("trainer.ray_address (or RAY_ADDRESS) 'no-such-host.invalid:6379': cannot resolve the "
                                "host 'no-such-host.invalid'")


def test_a_reward_model_column_of_text_is_named_as_such_not_as_a_missing_ground_truth(space, tmp_path):
    """A reward_model stored as JSON text (a CSV round trip) has no ground truth to read: preflight said only that
    the rows had none, which sent the user looking for nulls."""
    import pandas as pd

    frame = pd.read_parquet(space / "data" / "train.parquet")
    frame["reward_model"] = [json.dumps(dict(cell)) for cell in frame["reward_model"]]
    path = tmp_path / "train.parquet"
    frame.to_parquet(path)
    errors = _errors(_config(space, f"data.train_files={path}", "data.val_files=[]"))
    why = ("reward_model is the JSON text of a mapping, not a {style, ground_truth} mapping: parse it before "
           "writing the parquet (frame['reward_model'] = frame['reward_model'].map(json.loads))")
    assert len(frame) > 3  # three rows shown, and a sign that there are more
    assert errors[0] == (f"data.train_files: {len(frame)} rows' reward_model is no mapping: {path} row 0: {why}; "
                         f"{path} row 1: {why}; {path} row 2: {why}; ...")
    # and not also told as rows without a ground truth, whose advice is to train without one
    assert not any("have no reward_model.ground_truth" in error for error in errors), errors


def test_prompt_roles_outside_the_chat_format_are_refused_before_any_weights_load(space, tmp_path):
    """The trainer run alone trained on ShareGPT's human/gpt turns, which the chat template wrote as text or dropped;
    only the validate step refused them."""
    import pandas as pd

    frame = pd.read_parquet(space / "data" / "train.parquet")
    frame.at[1, "prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "human", "content": "What is 2+2?"}]
    frame.at[4, "prompt"] = [{"role": "gpt", "content": "Hi"}, {"role": "user", "content": "What is 3+3?"}]
    path = tmp_path / "train.parquet"
    frame.to_parquet(path)
    errors = _errors(_config(space, f"data.train_files={path}"))
    assert errors == [
        f"data.train_files: 2 prompt(s) have message roles outside the chat format (human, gpt), which a chat "
        f"template writes as text or drops: {path} row 1 (human); {path} row 4 (gpt); rename human -> user, "
        "gpt -> assistant (the chat format's roles: system, developer, user, assistant, tool, function, ipython)"]
    frame.rename(columns={"prompt": "messages"}).to_parquet(path)  # read from the column data.prompt_key names
    errors = _errors(_config(space, f"data.train_files={path}", "data.val_files=[]", "data.prompt_key=messages"))
    assert len(errors) == 1 and errors[0].startswith("data.train_files: 2 prompt(s) have message roles outside")


def test_a_file_of_preference_pairs_is_named_as_such_once_with_the_keys_that_give_it(space, tmp_path):
    """Preference pairs (prompt, chosen, rejected) as the prompt data: named as data a reward model trains on,
    once for the file that both data keys give, not as a data source missing from each."""
    import pandas as pd

    pairs = tmp_path / "pairs.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": "2+2?"}]] * 4,
                  "chosen": [[{"role": "assistant", "content": "4"}]] * 4,
                  "rejected": [[{"role": "assistant", "content": "5"}]] * 4}).to_parquet(pairs)
    errors = _errors(_config(space, f"data.train_files={pairs}", f"data.val_files={pairs}"))
    assert errors == [f"data.train_files, data.val_files: {pairs} has columns prompt, chosen, rejected: this is "
                      "preference data (a prompt with chosen and rejected responses), which trains a reward model "
                      "(rlhf train-rm, or reward_model.train in the pipelines); PPO training and evaluation read "
                      "prompt files (prompt, data_source, reward_model.ground_truth)"]
    # prompt data with chosen and rejected columns besides is prompt data
    frame = pd.read_parquet(space / "data" / "train.parquet")
    frame.assign(chosen="4", rejected="5").to_parquet(tmp_path / "prompts_and_pairs.parquet")
    preflight(_config(space, f"data.train_files={tmp_path / 'prompts_and_pairs.parquet'}"))


def test_a_reward_model_as_the_policy_is_refused_and_as_the_critic_taken(space, tmp_path):
    """A sequence-classification folder as actor_rollout_ref.model.path trained: its score head was dropped and a
    random LM head made. It is refused before any weights load, in the trainer's checks and in the dry run; as the
    critic's start (verl's usual) it still passes."""
    from rlhf_core.models.loading import ModelError
    from rlhf_core.pipeline.smoke import run_smoke_test

    rm = reward_model(space / "actor", tmp_path / "rm", 512)
    expected = (f"actor_rollout_ref.model.path: {rm} holds a reward/classification model (one score per sequence): "
                "LlamaForSequenceClassification, not a causal language model;")
    errors = _errors(_config(space, actor=rm))
    assert len(errors) == 1 and errors[0].startswith(expected), errors
    with pytest.raises(ModelError) as error:
        run_smoke_test(_config(space, actor=rm), tmp_path / "smoke")
    assert str(error.value).startswith(expected)
    preflight(_config(space, f"critic.model.path={rm}"))


@pytest.mark.parametrize(("architectures", "kind"), [
    (["Qwen2ForRewardModel"], "a reward model"),  # remote-code reward models: their own score head, no LM head
    (["InternLM2ForRewardModel"], "a reward model"),
    (["Qwen2ForProcessRewardModel"], "a process reward model"),
    (["LlamaForSequenceClassification"], "a reward/classification model"),
    (["Qwen2ForCausalLM"], None),
    (["Qwen2ForCausalLM", "Qwen2ForRewardModel"], None),  # one architecture generates: not refused
])
def test_reward_model_architectures_are_not_taken_as_a_policy(tmp_path, architectures, kind):
    from rlhf_core.models.loading import not_a_policy

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": architectures}))
    problem = not_a_policy(tmp_path)
    if kind is None:
        assert problem is None
    else:
        assert problem.startswith(f"{tmp_path} holds {kind} ") and "not a causal language model" in problem


def test_a_hub_id_as_the_model_path_says_nothing_is_downloaded_and_how_to_get_a_folder(space, tmp_path,
                                                                                       monkeypatch):
    from rlhf_core.models.loading import looks_like_hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()

    errors = _errors(_config(space, actor="Qwen/Qwen2.5-0.5B-Instruct"))
    assert errors == [
        "actor_rollout_ref.model.path: Qwen/Qwen2.5-0.5B-Instruct is not a directory: models load from local HF "
        "directories and nothing is downloaded at run time. If Qwen/Qwen2.5-0.5B-Instruct is a Hugging Face hub id, "
        "download it on a machine with access (huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR), "
        "copy DIR here and give its path; a GGUF file of it imports with rlhf gguf --gguf FILE --output DIR"]
    # a path that is not there but reads as a local one keeps the local advice
    errors = _errors(_config(space, actor=tmp_path / "no_model"))
    assert errors == [f"actor_rollout_ref.model.path: {tmp_path / 'no_model'} is not a directory (models load from "
                      "local HF directories; build the demo model with python -m rlhf_core.models.toy --output DIR)"]
    assert [looks_like_hub_id(p) for p in ("meta-llama/Llama-3.2-1B", "local/no_model", "./a/b", "a/b/c", "/x/y",
                                           "~/x", "gpt2")] == [True, False, False, False, False, False, False]


def test_a_file_without_the_prompt_column_is_reported_with_the_others_and_its_likely_column(space, tmp_path):
    """The missing prompt column was raised alone once the models had loaded, without the 'cannot start
    training:' heading, while a bad model path and a missing validation file were reported without it."""
    import pandas as pd

    frame = pd.read_parquet(space / "data" / "train.parquet").rename(columns={"prompt": "question"})
    frame.to_parquet(tmp_path / "question.parquet")
    cfg = _config(space, f"data.train_files={tmp_path / 'question.parquet'}",
                  f"data.val_files={tmp_path / 'none.parquet'}", actor=tmp_path / "no_model")
    with pytest.raises(PreflightError) as error:
        preflight(cfg)
    assert str(error.value).startswith("cannot start training:\n")
    assert [e.split(":")[0] for e in error.value.errors] == \
        ["actor_rollout_ref.model.path", "data.train_files", "data.val_files"]
    assert error.value.errors[1] == (
        "data.train_files: column(s) ['prompt'] missing; found ['data_source', 'question', 'ability', 'reward_model', "
        "'extra_info']; the prompts look to be in 'question': set data.prompt_key=question")
    preflight(_config(space, f"data.train_files={tmp_path / 'question.parquet'}", "data.prompt_key=question",
                      "data.val_files=[]"))
