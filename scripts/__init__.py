"""Tools run from the repository root (`python -m scripts.<name>`), not shipped."""
