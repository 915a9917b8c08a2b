"""The project's commands: argument parsing, printing and exit codes, one module per role."""
