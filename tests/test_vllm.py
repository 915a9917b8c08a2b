"""The vLLM rollout engine (GPU): generation under the RolloutEngine contract, weights pushed from the
actor in memory (a changed weight changes what vLLM generates), and a two-step PPO run with
``rollout/logprob_gap`` logged. Skipped without CUDA or vllm (``pip install -e .[gpu]``)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("the vLLM engine needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (pip install -e .[gpu])", allow_module_level=True)

from rlhf_core.cli.train import ppo  # noqa: E402
from rlhf_core.config import load_config  # noqa: E402
from rlhf_core.data.synthetic import build_dataset  # noqa: E402
from rlhf_core.models.loading import load_tokenizer  # noqa: E402
from rlhf_core.models.toy import random_toy_model  # noqa: E402
from rlhf_core.rollout import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    # 2 heads of 64: a head size every vLLM attention backend supports
    model = random_toy_model(root / "model", n_layers=2, hidden_size=128, max_position_embeddings=512, seed=0)
    build_dataset(root / "data", n_train=16, n_test=4, seed=0, max_ops=1)
    return root, model


@pytest.fixture(scope="module")
def actor(workspace):
    from rlhf_core.workers.actor import ActorWorker

    root, model = workspace
    cfg = load_config([f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=vllm",
                       "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.rollout.dtype=float32",
                       "trainer.device=cuda", "trainer.n_gpus_per_node=1"])
    return ActorWorker(cfg.resolved().actor_rollout_ref, load_tokenizer(model), total_steps=1, need_ref=False, device="cuda",
                       max_model_len=512)


def _prompts(workspace):
    from rlhf_core.data.dataset import RLHFDataset

    root, model = workspace
    cfg = load_config([f"actor_rollout_ref.model.path={model}", "data.max_prompt_length=320"])
    dataset = RLHFDataset(root / "data" / "train.parquet", load_tokenizer(model), cfg.data)
    return dataset.collate(list(range(4)))


def test_generation_follows_the_rollout_contract(actor, workspace):
    """Each row stops at its first EOS, which it keeps as its last valid token, padded after it. The EOS row of
    the LM head is moved towards the final norm's direction so that rows end: a random model gives EOS about
    once in its vocabulary's 100 draws, and half of the runs of 8 rows of 8 tokens held none (the same model on
    the HF engine, this boost: 4 to 7 of the 8 rows end, seeds 0-4)."""
    prompts = _prompts(workspace)
    tokenizer = load_tokenizer(workspace[1])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    head = actor.module.get_output_embeddings().weight
    saved = head.detach().clone()
    with torch.no_grad():
        norm = actor.module.model.norm.weight
        head[eos] += 7.0 * norm / norm.norm()
    actor.rollout.sync_weights()
    try:
        batch = actor.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=1.0))
        old_log_prob, _ = actor.compute_log_prob(batch)
    finally:
        with torch.no_grad():
            head.copy_(saved)
        actor.rollout.sync_weights()
    assert batch["responses"].shape == (8, 8) and batch["prompts"].shape[0] == 8
    mask = batch["response_mask"]
    assert ((mask[:, 1:] <= mask[:, :-1]).all()) and (mask.sum(-1) >= 1).all()  # a prefix of each row
    lengths = mask.sum(-1).tolist()
    ended = (batch["responses"] == eos) & mask.bool()
    assert ended.any()
    for row, length in enumerate(lengths):
        where = ended[row].nonzero().flatten().tolist()
        assert where in ([], [length - 1]), (row, where, length)  # EOS, when sampled, is the last valid token
        assert where or length == 8  # a row without EOS ran its whole budget
        assert batch["responses"][row, length:].eq(pad).all()
    gap = ((old_log_prob - batch["rollout_log_prob"]).abs() * mask).sum() / mask.sum()
    assert gap < 0.05, gap  # the same weights in both engines (float32)


def test_a_changed_actor_weight_changes_vllms_output_after_sync(actor, workspace):
    prompts = _prompts(workspace)
    greedy = SamplingParams(n=1, max_new_tokens=8, do_sample=False)
    before = actor.generate(prompts, greedy)["responses"]
    head = actor.module.lm_head.weight
    saved = head.detach().clone()
    with torch.no_grad():
        head.copy_(torch.randn_like(head))
    actor.rollout.sync_weights()
    changed = actor.generate(prompts, greedy)["responses"]
    with torch.no_grad():
        head.copy_(saved)
    actor.rollout.sync_weights()
    restored = actor.generate(prompts, greedy)["responses"]
    assert not torch.equal(before, changed)
    assert torch.equal(before, restored)


def test_two_ppo_steps_with_vllm_log_the_logprob_gap(workspace, tmp_path):
    root, model = workspace
    out = tmp_path / "run"
    code = ppo([
        f"actor_rollout_ref.model.path={model}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}", "data.train_batch_size=4", "data.max_prompt_length=320",
        "data.max_response_length=16", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
        "trainer.device=cuda", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.logger=[file]", f"trainer.default_local_dir={out}",
    ])
    assert code == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gaps = [s["rollout/logprob_gap"] for s in steps if "rollout/logprob_gap" in s]
    assert len(gaps) == 2 and all(math.isfinite(g) and g < 0.2 for g in gaps)  # bf16 rollout vs fp32 training
