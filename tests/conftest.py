"""Shared pytest setup for the Colibri test-suite.

* Slow tests (`@pytest.mark.slow`, real models) are skipped unless the
  environment has COLIBRI_SLOW=1 or the run selects them with `-m slow`.
* `tiny_model_dir(name)`: a session-scoped factory returning the directory of
  the tiny random HF checkpoint for a family (built once per session).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))


def _slow_enabled(config) -> bool:
    if os.environ.get("COLIBRI_SLOW", "").strip() not in ("", "0"):
        return True
    markexpr = config.getoption("markexpr", default="") or ""
    return "slow" in markexpr and "not slow" not in markexpr


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: larger real models; skipped unless COLIBRI_SLOW=1 or -m slow")


def pytest_sessionstart(session):
    # Build the native kernels once, before any test: a first-use build inside a child process (a CLI test
    # under its timeout, a memory-limited child) would be slow there, or fall back to the torch kernels.
    # Every tier this CPU runs is built (the cross-tier tests load them all), side by side: each build is one
    # compiler process, so two tiers take about the time of one on two cores.
    from concurrent.futures import ThreadPoolExecutor

    from colibri import kernels

    def build(name):
        try:
            kernels.ensure_built(kernels.TIERS[name])
        except kernels.KernelsUnavailable:
            pass  # the tier falls down when used, with its notice; the tests that need it say so

    names = kernels.runnable_tiers()
    with ThreadPoolExecutor(len(names)) as pool:
        list(pool.map(build, names))
    kernels.native()


def pytest_collection_modifyitems(config, items):
    if _slow_enabled(config):
        return
    skip = pytest.mark.skip(reason="slow test: set COLIBRI_SLOW=1 or run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: `tiny_model_dir("llama") -> Path` of a built tiny checkpoint (cached per session)."""
    import tiny_models

    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = tiny_models.build(name, root)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tier_ops():
    """{tier: its torch.ops namespace} for every native kernel tier this CPU runs, built once (the portable tier
    always): the cross-tier tests compare them."""
    from colibri import kernels

    built = {name: kernels.tier_ops(name) for name in kernels.runnable_tiers()}
    assert "portable" in built
    return built


@pytest.fixture(scope="session")
def aarch64_portable(tmp_path_factory):
    """The portable tier cross-compiled for aarch64 once a session, and the emulated machine that runs it
    (tests/aarch64_machine.py); skips where the cross compiler is missing."""
    import aarch64_machine

    try:
        machine = aarch64_machine.Machine(tmp_path_factory.mktemp("aarch64"))
    except aarch64_machine.Unavailable as e:
        pytest.skip(str(e))
    yield machine
    machine.close()


@pytest.fixture()
def artifacts(request, tmp_path) -> Path:
    """Where a test saves what a person may want to look at afterwards (screenshots): a directory per test under
    $COLIBRI_TEST_ARTIFACTS when set (.ci/run sets it to .ci/artifacts), else the test's tmp_path."""
    root = os.environ.get("COLIBRI_TEST_ARTIFACTS")
    if not root:
        return tmp_path
    out = Path(root) / request.node.name.replace("/", "_")
    out.mkdir(parents=True, exist_ok=True)
    return out
