"""What the pipeline steps call: smoke test, evaluation, promotion, lineage, scheduled retraining."""
