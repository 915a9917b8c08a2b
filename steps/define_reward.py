"""Pin down the reward: which function, with which parameters and source (a custom reward's files kept), checked on
the references."""

from __future__ import annotations

from typing import Annotated

from zenml import log_metadata, step
from zenml.logger import get_logger

from rlhf_core.config import PPOConfig
from rlhf_core.pipeline.evaluate import check_reference_solutions, reward_spec, spec_lines

logger = get_logger(__name__)


class RewardCheckError(ValueError):
    """A reference solution does not earn full marks; the message names the rows."""


@step(enable_cache=False)
def define_reward(ppo_config: dict, dataset_fingerprint: str) -> Annotated[dict, "reward_spec"]:
    """The versioned reward spec; stops the run when a reference solution scores below full marks."""
    cfg = PPOConfig.from_dict(ppo_config)
    spec = reward_spec(cfg, keep_source=True)  # a custom reward's files, read back by rlhf-lineage --reward-source
    check = check_reference_solutions(cfg)
    spec["self_check"] = {"dataset_fingerprint": dataset_fingerprint, "checked": check.checked,
                          "mismatches": check.mismatches[:20], "passed": check.success}
    log_metadata({"reward_sha256": spec["sha256"], "kind": spec["kind"],
                  "functions": {source: entry["function"] for source, entry in spec["functions"].items()},
                  "references_checked": check.checked, "reference_mismatches": len(check.mismatches)})
    if not check.success:
        logger.error(check.summary())
        raise RewardCheckError(check.summary())
    logger.info("%s\n%s", "\n".join(spec_lines(spec)), check.summary())
    return spec
