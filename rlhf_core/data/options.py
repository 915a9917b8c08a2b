"""What the data commands show in their help of the data library's settings, in a module that imports nothing:
the library's modules import pandas (seconds), and a command's ``--help`` and usage errors answer without it.
The library takes its settings from here."""

#: the layouts ``rlhf gsm8k`` reads (auto prefers jsonl where both are present)
GSM8K_LAYOUTS = ("auto", "jsonl", "parquet")
#: the synthetic arithmetic's operations, and the options it draws problems with by default
SYNTHETIC_OPERATIONS = ("+", "-", "*", "/")
SYNTHETIC_DEFAULTS = {
    "min_ops": 1,
    "max_ops": 3,
    "min_operand": 1,
    "max_operand": 20,
    "max_value": 999,
    "operations": SYNTHETIC_OPERATIONS,
}
#: said wherever preference pairs are built from GSM8K's test questions
TEST_SET_WARNING = (
    "These pairs are built from GSM8K *test* questions: do not evaluate on GSM8K test a policy "
    "trained against a reward model fitted on them (the reward would leak the test set)."
)
