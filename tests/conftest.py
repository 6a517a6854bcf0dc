# --- spec validation fixtures (tests/test_validate.py, test_cli.py, test_schema.py, test_plugins.py) ---
# Other fixtures may be appended below this block.

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs the suite on two workers: one torch thread each, so
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two workers on two cores do not oversubscribe them
    os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture
def cli():
    """Run the composer CLI in-process: cli("validate", path, ...) -> click Result (.exit_code, .stdout, .stderr)."""
    from click.testing import CliRunner

    from composer.cli.main import main

    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke

