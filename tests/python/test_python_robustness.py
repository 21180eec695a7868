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


# ---- what a new user tried (each used to pass silently or raise nanobind's TypeError) ----

def test_options_a_mode_would_ignore_are_errors_as_in_the_op():
    import numpy as np
    import fp8moe
    rng = np.random.default_rng()
    lhs = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((2, 8, 3)).astype(np.float32)
    gs = np.array([1, 3], np.int32)
    for kw, needle in (({"fp8_dtype": "e4m3fnuz"}, "fp8_dtype applies to modes fake_qat"),
                       ({"lhs_calibration": "fixed,-1,1"}, "lhs_calibration applies where"),
                       ({"scale_arithmetic": "xla_reciprocal"}, "scale_arithmetic applies")):
        with pytest.raises(ValueError, match=needle):
            fp8moe.gmm(lhs, w, gs, "f32", **kw)
    for kw in ({"calibration": "fixed,-1,1"}, {"per_group": False},
               {"scale_arithmetic": "xla_reciprocal"}):
        with pytest.raises(ValueError, match="applies when dout is quantized"):
            fp8moe.tgmm(lhs, rng.standard_normal((4, 3)).astype(np.float32), gs, "f32", **kw)
    with pytest.raises(ValueError, match="fp8_dtype applies to mode fake_qat"):
        fp8moe.dlhs(rng.standard_normal((4, 3)).astype(np.float32), w, gs, "f32",
                    fp8_dtype="e4m3fn")
    # Where they apply they still work, and leaving them out means the default.
    q, s = fp8moe.quantize(w, "e4m3fn", "channel")
    a = fp8moe.gmm(lhs, q, gs, "native_fp8", rhs_scale=s)
    b = fp8moe.gmm(lhs, q, gs, "native_fp8", rhs_scale=s, fp8_dtype="e4m3fn",
                   lhs_calibration="absmax", scale_arithmetic="exact_divide")
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_lists_odd_arrays_and_odd_arguments_give_clear_answers():
    import numpy as np
    import fp8moe
    # Lists: floats as float32, integers as int32 (np.asarray made f64 / i64).
    assert fp8moe.decode(fp8moe.cast([1.0, 2.0], "e4m3fn")).tolist() == [1.0, 2.0]
    out = fp8moe.gmm([[1.0, 2.0]], np.ones((1, 2, 2), np.float32), [1], "f32")
    assert out.dtype == np.float32 and out.tolist() == [[3.0, 3.0]]
    for bad, needle in ((np.array([1.0, 2.0], ">f4"), "non-native byte order"),
                        (np.array(["a", "b"]), "not numeric data"),
                        (np.array([object(), 1]), "not numeric data")):
        with pytest.raises(ValueError, match=needle):
            fp8moe.cast(bad, "bf16")
    with pytest.raises(ValueError, match="saturate must be True or False"):
        fp8moe.cast(np.ones(2, np.float32), "e4m3fn", saturate="no")
    for n in (1.5, "2", True):
        with pytest.raises(ValueError, match="must be an integer"):
            fp8moe.set_num_threads(n)
    with pytest.raises(ValueError, match=r"out of range"):
        fp8moe.set_num_threads(2**40)
    lhs, w, gs = np.ones((2, 2), np.float32), np.ones((1, 2, 2), np.float32), np.array([2], np.int32)
    with pytest.raises(ValueError, match=r"tiles\[0\]=9223372036854775808 is out of range"):
        fp8moe.gmm(lhs, w, gs, "f32", tiles=(2**63, None, None))
    with pytest.raises(ValueError, match=r"tiles\[1\] must be an integer"):
        fp8moe.gmm(lhs, w, gs, "f32", tiles=(None, 2.5, None))
    import ml_dtypes
    for dt, want in ((np.float32, np.float32), ("float32", np.float32),
                     (ml_dtypes.bfloat16, ml_dtypes.bfloat16)):
        assert fp8moe.gmm(lhs, w, gs, "f32", out_dtype=dt).dtype == want
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
        fp8moe.gmm(lhs, w, gs, "f32", out_dtype=np.float64)
