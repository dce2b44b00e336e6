"""queue-gateway: a queueing gateway for slow, rate-limited APIs."""

from importlib.resources import files
from pathlib import Path

__version__ = "0.1.0"

#: The repository root, in a checkout: `lua/` and `alembic/` are edited there.
ROOT = Path(__file__).resolve().parent.parent


def data_path(name: str) -> Path:
    """`lua` or `alembic`: inside the installed package (a wheel ships them as `app/<name>`,
    see setup.py), else beside the package in a checkout (an editable install)."""
    shipped = files(__name__) / name
    if isinstance(shipped, Path) and shipped.is_dir():
        return shipped
    return ROOT / name
