"""Prometheus gauges of a running trainer, for a live Grafana dashboard.

With ``trainer.prometheus_port=PORT`` the command line serves, on ``127.0.0.1:PORT/metrics``,
one gauge per quantity below, updated after every logged step and labelled with the
run's ``project`` and ``experiment``. ``configs/monitoring/prometheus.yml`` scrapes it and
``configs/monitoring/grafana_dashboard.json`` plots it.

Each gauge maps to the first of its metric keys present in a step's metrics (a step
without any of them leaves the gauge as it was, NaN until its first value: a GRPO run has no critic, a
resumed run no validation yet); ``rlhf_kl`` is the step's KL as the KL
guard measures it (:func:`~rlhf_core.training.guards.measured_kl`: ``inf`` where one is not finite). A value
is served as it is, ``+Inf`` included (a diverged KL or grad norm crosses the dashboard's thresholds and any
alert on them, where NaN would draw a gap and compare false). The exporter has its own
registry, so several can live in one process (tests) without clashing with the default one.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from rlhf_core.training.guards import KL_METRICS, measured_kl

#: gauge name -> (help, metric keys tried in order)
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "rlhf_global_step": ("last finished PPO step", ("training/global_step",)),
    "rlhf_step_time_seconds": ("wall time of the last step", ("timing_s/step",)),
    "rlhf_rollout_tokens_per_second": ("generated response tokens per second of rollout",
                                       ("perf/rollout_tokens_per_s",)),
    "rlhf_throughput_tokens_per_second": ("prompt+response tokens per second of the whole step, per worker",
                                          ("perf/throughput",)),
    "rlhf_response_length_mean": ("mean response length (tokens)", ("response_length/mean",)),
    "rlhf_reward_mean": ("mean sequence score of the rollout batch", ("critic/score/mean",)),
    "rlhf_kl": ("KL of the step per token: the largest of " + ", ".join(KL_METRICS)
                + " (the KL loss as actor/kl_loss_token_mean where logged)", ()),
    "rlhf_actor_grad_norm": ("actor gradient norm before clipping", ("actor/grad_norm",)),
    "rlhf_critic_grad_norm": ("critic gradient norm before clipping", ("critic/grad_norm",)),
    "rlhf_skipped_steps": ("mini-batch updates skipped for a non-finite loss or gradient, in total",
                           ("training/skipped_steps",)),
    "rlhf_rollbacks": ("guard rollbacks in this run", ("training/rollbacks",)),
    "rlhf_val_accuracy": ("mean validation accuracy of the last validation", ()),
    "rlhf_val_reward": ("mean validation reward (what PPO maximises) of the last validation", ()),
}


class PortInUseError(OSError):
    """The Prometheus port is taken."""


class PrometheusExporter:
    """Serves the gauges of :data:`GAUGES` on ``addr:port``; ``log(metrics, step)`` updates them."""

    def __init__(self, port: int, project: str = "", experiment: str = "", addr: str = "127.0.0.1"):
        self.registry = CollectorRegistry()
        labels = {"project": project, "experiment": experiment}
        self.gauges = {name: Gauge(name, help_text, list(labels), registry=self.registry).labels(**labels)
                       for name, (help_text, _) in GAUGES.items()}
        for gauge in self.gauges.values():  # unknown until measured (not 0: a resumed run's accuracy is not 0)
            gauge.set(math.nan)
        try:
            self.server, self.thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(exc.errno, f"trainer.prometheus_port={port}: {addr}:{port} is already in use; "
                                                "choose another port or null to switch the exporter off") from exc
            raise
        self.port = self.server.server_address[1]
        self.url = f"http://{addr}:{self.port}/metrics"

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, (_, keys) in GAUGES.items():
            for key in keys:
                value = metrics.get(key)
                if value is not None:
                    self.gauges[name].set(float(value))  # inf stays inf: over every threshold, not a gap
                    break
        kl = measured_kl(metrics)
        if kl is not None:
            self.gauges["rlhf_kl"].set(kl)  # (inf where a KL is not finite, as the KL guard reads it)
        accuracies = [float(v) for k, v in metrics.items() if k.startswith("val-core/") and "/acc/mean@" in k]
        if accuracies:
            self.gauges["rlhf_val_accuracy"].set(sum(accuracies) / len(accuracies))
        # val-aux beside an accuracy, val-core where there is none (prompts without a ground truth)
        rewards = [float(v) for k, v in metrics.items()
                   if k.startswith(("val-core/", "val-aux/")) and "/reward/mean@" in k]
        if rewards:
            self.gauges["rlhf_val_reward"].set(sum(rewards) / len(rewards))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
