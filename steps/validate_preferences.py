"""Check the reward model's preference files before it trains: schema, texts, no question on both sides."""

from __future__ import annotations

from typing import Annotated

from zenml import log_metadata, step
from zenml.logger import get_logger

from rlhf_core.data.dataset import as_file_list
from rlhf_core.data.preference import check_preference_files
from rlhf_core.data.validation import fingerprint
from steps._config import config_from_dict

logger = get_logger(__name__)


@step(enable_cache=False)
def validate_preferences(ppo_config: dict) -> Annotated[str, "preference_fingerprint"]:
    """The SHA-256 of the preference files; stops the run on any problem (named by file and row)."""
    rm = config_from_dict(ppo_config).reward_model.train
    train = as_file_list(rm.train_files)
    val = as_file_list(rm.val_files) if rm.val_files is not None else []
    summary = check_preference_files(train, val)
    digest = fingerprint([*train, *val])
    log_metadata({"preference_fingerprint": digest, **summary})
    logger.info("preference data: %s", summary)
    return digest
