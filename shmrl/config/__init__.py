"""The settings of a run, each declared once, the command-line flags built from them, presets and exit codes."""
