# --- spec validation fixtures (tests/test_validate.py, test_cli.py, test_schema.py, test_plugins.py) ---
# Other fixtures may be appended below this block.

import pytest


@pytest.fixture
def cli():
    """Run the composer CLI in-process: cli("validate", path, ...) -> click Result (.exit_code, .stdout, .stderr)."""
    from click.testing import CliRunner

    from composer.cli.main import main

    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke

