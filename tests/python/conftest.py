import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
