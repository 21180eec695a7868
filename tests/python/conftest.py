import os
import pathlib
import signal
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A suite started in the background by a non-interactive shell (`cmd &` in a
# script, nohup) inherits SIGINT ignored, and so does every fp8moe it starts;
# fp8moe keeps an ignored SIGINT ignored (nohup's contract, tested in
# test_robustness.py), so the tests that interrupt it would hang. Catching
# SIGINT here gives the children the default action again (exec resets caught
# signals, not ignored ones), as when the suite runs in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def fp8moe_bin():
    path = os.environ.get("FP8MOE_BIN", str(ROOT / "build/release/cli/fp8moe"))
    if not os.path.exists(path):
        pytest.fail(f"fp8moe binary not found at {path}; build first or set FP8MOE_BIN")
    return path


@pytest.fixture
def run_op(fp8moe_bin, tmp_path):
    """Runs `fp8moe op NAME` on a dict of arrays; returns (exit code, outputs, stderr)."""
    import st

    def run(name, tensors, *keys, metadata=None):
        src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
        st.write(src, tensors, metadata)
        if dst.exists():
            dst.unlink()
        p = subprocess.run([fp8moe_bin, "op", name, "--in", str(src), "--out", str(dst), *keys],
                           capture_output=True, text=True)
        outs = st.read(dst) if p.returncode == 0 else None
        return p.returncode, outs, p.stderr

    return run


# ---- Replayable randomness (FP8MOE_TEST_SEED, as in the C++ tests) ----
#
# Tests draw fresh random inputs with np.random.default_rng(). Every unseeded
# call in a test is given the seed [S, i] (i: the call's index in the test),
# where S is FP8MOE_TEST_SEED when set, else drawn at random; a failing test
# prints `FP8MOE_TEST_SEED=S` so that the same inputs can be replayed.
import numpy as _np

_ORIGINAL_DEFAULT_RNG = _np.random.default_rng


@pytest.fixture(autouse=True)
def _replayable_default_rng(request, monkeypatch):
    env = os.environ.get("FP8MOE_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    calls = [0]

    def default_rng(seed_arg=None, *args, **kwargs):
        if seed_arg is None:
            seed_arg = [seed, calls[0]]
            calls[0] += 1
        return _ORIGINAL_DEFAULT_RNG(seed_arg, *args, **kwargs)

    monkeypatch.setattr(_np.random, "default_rng", default_rng)
    request.node._fp8moe_seed = seed
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "_fp8moe_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("replay", f"FP8MOE_TEST_SEED={seed} replays this test's "
                                          "random inputs"))


# ---- The command's tests only (scripts/test's sanitizer stage) ----
#
# FP8MOE_COMMAND_TESTS_ONLY=1 deselects the tests that never start the fp8moe
# command (those of the Python package and the layering check): under a
# sanitized FP8MOE_BIN they would rerun the unsanitized package's tests for
# nothing. pytest's summary counts them as deselected.
def pytest_collection_modifyitems(config, items):
    if os.environ.get("FP8MOE_COMMAND_TESTS_ONLY") != "1":
        return
    keep = [item for item in items if "fp8moe_bin" in item.fixturenames]
    dropped = [item for item in items if "fp8moe_bin" not in item.fixturenames]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
