"""queue-gateway: a queueing gateway for slow, rate-limited APIs."""

from pathlib import Path

__version__ = "0.1.0"

#: The repository root: `lua/` and `alembic/` live beside the package.
ROOT = Path(__file__).resolve().parent.parent
