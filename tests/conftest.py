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


# the real-job tier (marked cluster): `make test` runs it beside the suite, on one of the two xdist workers
TIER = {"tests/test_openrlhf_real.py"}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_runtest_setup(item):
    """On an xdist worker, the suite's tests run at the lowest CPU priority (nice 19, inherited by the
    processes they start): beside the real-job tier, the longest chain of the call, they take the CPU its jobs
    leave idle instead of stalling them (Ray starts its workers at nice 15)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and _file(item.nodeid) not in TIER:
        os.nice(max(0, 19 - os.nice(0)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (the dev extra): absent, pytest runs without it
def pytest_xdist_make_scheduler(config, log):
    """xdist's `load` scheduling, but the tier's tests are one unit that goes out first: they run in order on
    one worker, with one Ray head, and each module-scoped job runs once, while the other worker takes the
    suite's tests one by one (at nice 19: pytest_runtest_setup).
    xdist's own `--dist loadgroup` would do this with marks, but xdist 3.8 renames the test ids through an
    attribute pytest 9 no longer reads, so its groups are silently ignored."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TierFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # a unit: the tier's file, or one test of the suite
            return _file(nodeid) if _file(nodeid) in TIER else nodeid

    return TierFirst(config, log)


# --- a tiny model and a finished run on it, for the tests of hostile and careless input (tests/_helpers.py) ---
# A test file's own fixture of the same name takes precedence; each module builds its own (module scope).


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def finished_run(tiny, tmp_path_factory):
    """A one-step run on the tiny model: a checkpoint and model/ to export, tamper with and resume."""
    from _helpers import cli

    out = tmp_path_factory.mktemp("run") / "run"
    r = cli("run", "specs/sft.yaml", f"policy.model={tiny}", "train.steps=1", "train.prompts_per_step=2",
            "train.eval_every=0", "train.eval_samples=2", "--no-progress", "--out", out)
    assert r.exit_code == 0, r.output
    return out
