"""What the pipeline steps call: smoke test, evaluation, promotion, lineage, scheduled retraining."""

from rlhf_core.progress import plain_colours

plain_colours()  # before this package's modules import ZenML (rlhf-schedule, rlhf-lineage, rlhf-demo-summary)
