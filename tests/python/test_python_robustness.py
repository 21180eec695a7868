"""The Python package against hostile calls: tests/python/python_campaign.py
(every public function of fp8moe and fp8moe.jax with wrong dtypes, shapes,
strides, zero-size and enormous arrays, bad group sizes, integers and
strings) runs in a subprocess, so a crash (a signal, libgomp or abort exiting
the process) fails the test instead of killing pytest; a contract break
(another exception, an empty message) fails it too. Each run has a timeout."""
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
# The memory cap keeps a call that would allocate terabytes a MemoryError.
ENV = dict(os.environ, FP8MOE_MEMORY_CAP="1G", OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
SEED = int(os.environ.get("FP8MOE_TEST_SEED", "0"))


def campaign(seed, calls, *extra, timeout=300):
    p = subprocess.run([sys.executable, str(HERE / "python_campaign.py"), str(seed), str(calls),
                        *extra], capture_output=True, text=True, errors="replace",
                       timeout=timeout, env=ENV)
    last_call = p.stderr.strip().splitlines()[-1:] if p.stderr.strip() else []
    assert p.returncode == 0, (f"exit {p.returncode}; last call: {last_call}\n"
                               f"{p.stdout[-3000:]}\n{p.stderr[-1500:]}")
    assert "0 contract breaks" in p.stdout, p.stdout[-3000:]
    return p.stdout


@pytest.mark.parametrize("seed", [SEED * 10 + i for i in range(3)])
def test_numpy_api_campaign_never_crashes(seed):
    out = campaign(seed, 1500)
    print(out.strip().splitlines()[-1])


def test_set_num_threads_past_the_bound_is_a_value_error():
    # 2^31 - 1 threads made libgomp exit the process at the next parallel
    # region ("Out of memory allocating 481036338272 bytes").
    code = ("import fp8moe, numpy as np\n"
            "for n in (0, -1, 1025, 2**31 - 1):\n"
            "    try:\n"
            "        fp8moe.set_num_threads(n)\n"
            "        raise SystemExit(f'accepted {n}')\n"
            "    except ValueError as e:\n"
            "        assert 'must be in [1, 1024]' in str(e), e\n"
            "fp8moe.set_num_threads(1)\n"
            "print(fp8moe.gmm(np.ones((2, 2), np.float32), np.ones((1, 2, 2), np.float32),\n"
            "                 np.array([2], np.int32), 'f32').sum())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=ENV)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "8.0", p.stdout


def test_jax_api_campaign_never_crashes():
    pytest.importorskip("jax")
    import fp8moe
    if "XLA FFI handlers built" not in fp8moe.info():
        pytest.skip("fp8moe was built without the XLA FFI handlers")
    out = campaign(SEED * 10 + 7, 300, "jax", timeout=600)
    print(out.strip().splitlines()[-1])
