"""FSDP2 in a one-rank process group, without Ray: the actor (with its sharded reference) and the LoRA critic
wrapped by ``fully_shard`` give the log-probs, values, update metrics and weights of the same workers unsharded.
On the CPU over gloo here; on one CUDA GPU over NCCL (``gpu``), where the default bfloat16 gathering is
checked against float32 too. Each case runs in a process of its own, so that its process group ends with it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_core.models.toy import random_toy_model

TESTS = Path(__file__).resolve().parent
PARAMS = ("actor_rollout_ref.actor.fsdp_config.param_dtype", "actor_rollout_ref.ref.fsdp_config.param_dtype",
          "critic.fsdp_config.param_dtype")

# runs in the child: the workers unsharded, then (after joining a one-rank group) sharded, on the same batch
CHILD = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_distributed import UPDATE_OVERRIDES, _config, rollout_batch
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.workers import distributed
from rlhf_core.workers.actor import ActorWorker
from rlhf_core.workers.critic import CriticWorker

model, device, port, overrides = {model!r}, {device!r}, {port!r}, {overrides!r}
cfg = _config(model, *UPDATE_OVERRIDES, *overrides)
tokenizer, batch, n = load_tokenizer(model), rollout_batch(), cfg.actor_rollout_ref.rollout.n
packed = []

def update():
    resolved = cfg.resolved()
    actor = ActorWorker(resolved.actor_rollout_ref, tokenizer, total_steps=1, need_ref=True, seed=0, device=device)
    critic = CriticWorker(resolved.critic, "float32", 1, seed=0, device=device)
    packed.append(actor.remove_padding and critic.remove_padding)
    log_prob, _ = actor.compute_log_prob(batch)
    ref_log_prob = actor.compute_ref_log_prob(batch)
    values = critic.compute_values(batch)
    metrics = {{**actor.update_policy(batch, n), **critic.update_critic(batch, n)}}
    weights = {{**{{"actor." + k: v for k, v in distributed.full_state_dict(actor.module).items()}},
               **{{"critic." + k: v for k, v in distributed.full_state_dict(critic.module).items()}}}}
    return actor.sharded, {{"log_prob": log_prob.cpu(), "ref_log_prob": ref_log_prob.cpu(), "values": values.cpu()}}, \\
        metrics, weights

plain_sharded, plain, plain_metrics, plain_weights = update()
distributed.init_process_group(0, 1, "127.0.0.1", port, distributed.backend_for(device), timeout_s=120)
sharded_flag, sharded, sharded_metrics, sharded_weights = update()
torch.save({{"flags": [plain_sharded, sharded_flag], "packed": packed, "plain": plain, "sharded": sharded,
            "plain_weights": plain_weights, "sharded_weights": sharded_weights}}, sys.argv[1])
print(json.dumps({{"plain": plain_metrics, "sharded": sharded_metrics}}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_both(tmp_path: Path, device: str, *overrides: str) -> tuple[dict, dict]:
    """The child's tensors (unsharded and sharded) and update metrics."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    model = str(random_toy_model(tmp_path / "model", n_layers=2, hidden_size=32, max_position_embeddings=512,
                                 seed=0))
    code = CHILD.format(tests=str(TESTS), model=model, device=device, port=_free_port(), overrides=list(overrides))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tensors.pt")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return torch.load(tmp_path / "tensors.pt"), json.loads(out.stdout.strip().splitlines()[-1])


def assert_same(tensors: dict, metrics: dict, rtol: float, atol: float) -> None:
    assert tensors["flags"] == [False, True]  # unsharded first, then sharded by joining the group
    for key, value in tensors["plain"].items():
        torch.testing.assert_close(tensors["sharded"][key], value, rtol=rtol, atol=atol, msg=key)
    # grad clipping is active (norms above grad_clip 0.05), so the norm over the shards matters
    assert metrics["plain"]["actor/grad_norm"] > 0.05 and metrics["plain"]["critic/grad_norm"] > 0.05
    for name, value in metrics["plain"].items():
        if "clipfrac" not in name and not name.startswith(("perf/", "timing")):  # clip fractions count rounding ties
            assert metrics["sharded"][name] == pytest.approx(value, rel=max(rtol, 1e-4), abs=atol), name
    assert tensors["sharded_weights"].keys() == tensors["plain_weights"].keys()
    for name, value in tensors["plain_weights"].items():
        torch.testing.assert_close(tensors["sharded_weights"][name].float(), value.float(), rtol=rtol, atol=atol,
                                   msg=name)


@pytest.mark.parametrize("overrides", [(), ("actor_rollout_ref.model.use_remove_padding=true",
                                              "critic.model.use_remove_padding=true")], ids=["padded", "packed"])
def test_fsdp2_on_one_cpu_rank_updates_as_the_unsharded_workers(tmp_path, overrides):
    """Packed rows too: sharded, the actor asks the root module for the response positions' logits only."""
    tensors, metrics = run_both(tmp_path, "cpu", *overrides)
    assert tensors["packed"] == [bool(overrides)] * 2
    assert_same(tensors, metrics, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp2_on_one_gpu_updates_as_the_unsharded_workers(tmp_path):
    # float32 gathering: the same arithmetic as the unsharded workers
    tensors, metrics = run_both(tmp_path / "fp32", "cuda", *(f"{key}=float32" for key in PARAMS))
    assert_same(tensors, metrics, rtol=1e-4, atol=1e-5)
    # the default, bfloat16 gathering: the forward passes in bfloat16, close to float32's
    tensors, _ = run_both(tmp_path / "bf16", "cuda")
    assert tensors["flags"] == [False, True]
    for key, value in tensors["plain"].items():
        torch.testing.assert_close(tensors["sharded"][key], value, rtol=0.05, atol=0.05, msg=key)
