"""Thin DVC entry points: `python -m stages.NAME --params params.yaml [-S section.key=value ...]`."""
