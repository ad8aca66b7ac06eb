"""Process-wide settings every test and every rank it spawns inherits (set before anything imports
DeepSpeed): DeepSpeed's CPU accelerator, and its one-time shm op build cached in the build tree rather
than in the home directory."""

import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def shipped_measured_bundle():
    """The shipped measured bundle, read (and validated) once per session: reading it takes seconds, and
    the tests that replay or predict it only filter it."""
    import traces

    return traces.read_bundle(traces.measured_bundle_path())
