"""The deployment file: its dataclasses, parsing and the YAML field readers."""
