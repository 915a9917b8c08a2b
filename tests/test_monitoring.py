"""Monitoring: the Prometheus exporter (scraped for real on 127.0.0.1, also during a CLI run), the
console warnings wired from trainer.warn_*, and the Grafana / Prometheus files matching the gauges."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_real_tokenizer import ScriptedLM

from rlhf_core.cli.train import ppo
from rlhf_core.config import load_config
from rlhf_core.data.synthetic import build_dataset
from rlhf_core.main_ppo import build_trainer
from rlhf_core.models.toy import random_toy_model
from rlhf_core.rollout import make_rollout_engine
from rlhf_core.training.monitoring import GAUGES, PortInUseError, PrometheusExporter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("rlhf_")}


def test_exporter_serves_every_gauge_from_a_steps_metrics():
    with PrometheusExporter(free_port(), project="p", experiment="e") as exporter:
        assert exporter.url.startswith("http://127.0.0.1:")
        exporter.log({"training/global_step": 101}, step=101)  # a resumed run's first step, before validating
        first = scrape(exporter.url)
        assert first["rlhf_global_step"] == 101 and set(first) == set(GAUGES)
        assert all(math.isnan(value) for name, value in first.items() if name != "rlhf_global_step")  # not 0
        exporter.log({"training/global_step": 7, "timing_s/step": 1.5, "perf/rollout_tokens_per_s": 320.0,
                      "perf/throughput": 900.0, "response_length/mean": 12.0, "critic/score/mean": 0.25,
                      "actor/reward_kl_penalty": 0.03, "actor/grad_norm": 0.7, "critic/grad_norm": float("nan"),
                      "training/skipped_steps": 2, "training/rollbacks": 1,
                      "val-core/a/acc/mean@1": 0.4, "val-core/b/acc/mean@1": 0.6, "val-aux/a/reward/mean@1": 0.3,
                      "val-aux/a/gold_reward/mean@1": 0.9, "val-core/b/reward/mean@1": 0.7}, step=7)
        values = scrape(exporter.url)
        assert set(values) == set(GAUGES)
        expected = {"rlhf_global_step": 7, "rlhf_step_time_seconds": 1.5, "rlhf_rollout_tokens_per_second": 320,
                    "rlhf_throughput_tokens_per_second": 900, "rlhf_response_length_mean": 12,
                    "rlhf_reward_mean": 0.25, "rlhf_kl": 0.03, "rlhf_actor_grad_norm": 0.7,
                    "rlhf_skipped_steps": 2, "rlhf_rollbacks": 1, "rlhf_val_accuracy": 0.5,
                    "rlhf_val_reward": 0.5}  # (0.3 beside a's accuracy, 0.7 as b's core metric) / 2
        assert {k: values[k] for k in expected} == pytest.approx(expected)
        assert math.isnan(values["rlhf_critic_grad_norm"])
        exporter.log({"actor/ppo_kl": 0.01, "actor/reward_kl_penalty": 0.5, "actor/kl_loss": 0.2}, step=8)
        assert scrape(exporter.url)["rlhf_kl"] == pytest.approx(0.5)  # the largest, as the KL guard reads it
        url = exporter.url
    with pytest.raises(urllib.error.URLError):
        scrape(url)


def test_a_diverged_kl_or_grad_norm_is_served_as_infinite_not_as_unknown():
    """+Inf is above the dashboard's red line (and any alert's); NaN, the gauges' "no value yet", is above nothing."""
    with PrometheusExporter(free_port()) as exporter:
        exporter.log({"actor/grad_norm": float("inf"), "actor/kl_loss": float("nan"), "actor/ppo_kl": 0.01,
                      "critic/grad_norm": float("nan")}, step=3)
        values = scrape(exporter.url)
    assert values["rlhf_actor_grad_norm"] == math.inf
    assert values["rlhf_kl"] == math.inf  # a KL that is not finite, as the KL guard reads it
    assert math.isnan(values["rlhf_critic_grad_norm"])  # NaN is served as NaN


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"trainer.prometheus_port={port}: 127.0.0.1:{port} is already in use"):
            PrometheusExporter(port)


def test_dashboard_and_scrape_config_cover_the_gauges(repo_root):
    dashboard = json.loads((repo_root / "configs" / "monitoring" / "grafana_dashboard.json").read_text())
    plotted = {target["expr"].split("{")[0] for panel in dashboard["panels"] for target in panel["targets"]}
    assert plotted == set(GAUGES)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    scrape_config = yaml.safe_load((repo_root / "configs" / "monitoring" / "prometheus.yml").read_text())
    (job,) = scrape_config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["127.0.0.1:9400"]


@pytest.fixture
def tiny_run(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = random_toy_model(tmp_path / "model", n_layers=1, hidden_size=32, max_position_embeddings=512, seed=0)
    build_dataset(tmp_path / "data", n_train=16, n_test=4, seed=0, max_ops=1)
    (tmp_path / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str[:1].isdigit() else 0.0\n")
    yield [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
        f"data.val_files={tmp_path / 'data' / 'test.parquet'}", "data.train_batch_size=8",
        "data.max_prompt_length=320", "data.max_response_length=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false", "actor_rollout_ref.actor.optim.lr=5e-2",
        "actor_rollout_ref.actor.ppo_epochs=2", f"custom_reward_function.path={tmp_path / 'reward.py'}",
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.val_before_train=false",
        "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / 'out'}",
    ]
    torch.set_num_threads(threads)


def test_cli_serves_gauges_during_the_run_and_warns_on_thresholds(tiny_run, capsys):
    port = free_port()
    seen: list[dict[str, float]] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                seen.append(scrape(f"http://127.0.0.1:{port}/metrics"))
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        code = ppo([*tiny_run, f"trainer.prometheus_port={port}", "trainer.logger=[console]",
                     "trainer.warn_kl=1e-12", "trainer.warn_grad_norm=1e-12"])
    finally:
        done.set()
        poller.join(timeout=5)
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert f"prometheus metrics at http://127.0.0.1:{port}/metrics" in err
    during = [s for s in seen if s.get("rlhf_global_step", 0) >= 1]
    assert during, f"no scrape saw a finished step ({len(seen)} scrapes)"
    assert during[-1]["rlhf_global_step"] in (1, 2) and during[-1]["rlhf_step_time_seconds"] > 0
    assert during[-1]["rlhf_rollout_tokens_per_second"] > 0 and during[-1]["rlhf_response_length_mean"] > 0
    assert "WARNING KL" in out and "actor grad_norm" in out and "> 1e-12" in out
    with pytest.raises(urllib.error.URLError):  # the exporter stops with the run
        scrape(f"http://127.0.0.1:{port}/metrics")


def test_rollout_tokens_per_second_counts_the_response_tokens(tiny_run):
    trainer = build_trainer(load_config([*tiny_run, "trainer.logger=[]"]))
    try:
        tokenizer = trainer.tokenizer
        digit, eos = tokenizer.convert_tokens_to_ids("7"), tokenizer.eos_token_id
        # response lengths by hand, EOS included; the third row never ends and is cut at max_response_length=8,
        # the others end early, so the (8, 8) response block holds 64 positions of which 26 are response tokens
        lengths = [3, 1, 8, 2, 5, 4, 1, 2]
        scripts = [[digit] * (length - 1) + [eos] for length in lengths]
        scripts[2] = [digit]
        trainer.actor.rollout = make_rollout_engine("hf", ScriptedLM(scripts, eos, len(tokenizer)), tokenizer)
        metrics = trainer.train_step(trainer.train_dataset.collate(trainer.sampler.next_batch()[1]))
    finally:
        trainer.close()
    assert metrics["perf/rollout_tokens_per_s"] * metrics["timing_s/gen"] == pytest.approx(26)
