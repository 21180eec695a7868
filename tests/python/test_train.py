"""`fp8moe train` and `fp8moe report` end to end on tiny runs: resuming after
SIGKILL (also in the middle of a save) gives the bits of an uninterrupted run;
a full disk while saving, bad flags, bad data, a checkpoint of another model
and a diverging run are clear errors with exit code 2; the report PNG is
drawn. Checkpoints are read with tests/python/st.py, not fp8moe's reader."""
import json
import os
import pathlib
import random
import signal
import struct
import subprocess
import time

import numpy as np
import pytest

import st

TINY = ["base_emb_dim=16", "base_num_decoder_layers=2", "base_num_query_heads=2", "head_dim=8",
        "base_moe_mlp_dim=16", "max_target_length=16", "per_device_batch_size=4", "vocab_size=40",
        "synthetic_alphabet_size=8", "eval_steps=2", "log_period=5"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def train(fp8moe_bin, out, name, *flags, timeout=120, prefix=(), **kw):
    cmd = [*prefix, fp8moe_bin, "train", f"base_output_directory={out}", f"run_name={name}",
           *TINY, *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, **kw)


def checkpoints(run):
    return sorted((run / "checkpoints").glob("step_*.safetensors"))


def assert_readable(run):
    for c in checkpoints(run):
        st.read(c)  # raises on a torn or malformed file


def logged_steps(run):
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigkill_at_random_moments_loses_nothing_but_steps(fp8moe_bin, tmp_path):
    steps = 40
    flags = [f"steps={steps}", "checkpoint_period=2", "eval_interval=10"]
    whole = train(fp8moe_bin, tmp_path, "whole", *flags)
    assert whole.returncode == 0, whole.stderr
    rng = random.Random(int(os.environ.get("FP8MOE_TEST_SEED", "7")))
    run = tmp_path / "killed"
    # Four kills, each once the run has logged a random step past the last
    # kill's, then after a random delay of up to 5 ms: the kill
    # lands while training, evaluating or in the middle of a save (one save
    # every 2 steps), whatever the machine's speed.
    targets = sorted(rng.sample(range(3, steps - 8), 4))
    kills = 0
    for target in targets:
        p = subprocess.Popen([fp8moe_bin, "train", f"base_output_directory={tmp_path}",
                              "run_name=killed", *TINY, *flags],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
        while p.poll() is None and logged_steps(run) < target:
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.005))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        assert_readable(run)  # never a corrupt checkpoint, whenever the kill came
        assert not (run / "summary.json").exists()
    assert kills == len(targets)
    done = train(fp8moe_bin, tmp_path, "killed", *flags)
    assert done.returncode == 0, done.stderr
    a = st.read(checkpoints(tmp_path / "whole")[-1])
    b = st.read(checkpoints(run)[-1])
    assert checkpoints(run)[-1].name == f"step_{steps:08d}.safetensors"
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k
    # metrics.jsonl holds each step once.
    logged = [int(l.split('"step":')[1].split(",")[0]) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))


def test_full_disk_while_saving_is_a_clear_error_and_keeps_the_last_checkpoint(fp8moe_bin, tmp_path):
    ok = train(fp8moe_bin, tmp_path, "disk", "steps=4", "checkpoint_period=4", "eval_interval=0")
    assert ok.returncode == 0, ok.stderr
    before = checkpoints(tmp_path / "disk")
    size = before[0].stat().st_size
    # A file-size limit below one checkpoint: the next save fails with EFBIG.
    limit = size // 2

    # prlimit (util-linux), not preexec_fn: pytest has JAX's threads, and a
    # fork that runs Python code before exec can deadlock.
    p = train(fp8moe_bin, tmp_path, "disk", "steps=8", "checkpoint_period=4", "eval_interval=0",
              prefix=["prlimit", f"--fsize={limit}"])
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "cannot save the checkpoint of step 8" in p.stderr, p.stderr
    assert "step_00000004.safetensors' (intact)" in p.stderr, p.stderr
    assert checkpoints(tmp_path / "disk") == before
    assert_readable(tmp_path / "disk")
    assert not list((tmp_path / "disk" / "checkpoints").glob("*.tmp.*"))


def test_bad_input_is_a_clear_error_with_exit_code_2(fp8moe_bin, tmp_path):
    cases = [
        (["stpes=10"], "did you mean 'steps'?"),
        (["dataset_type=text", f"dataset_path={tmp_path}/missing.txt", "vocab_size=256"],
         "cannot read dataset_path"),
        (["dataset_type=txt"], "did you mean 'text'?"),
        (["quantization=int8"], "both claim the expert GMMs"),
        (["head_dim=7"], "head_dim=7"),
        # Silently ignored before: a text file with the synthetic data, an eval
        # share outside (0, 1) with synthetic data.
        ([f"dataset_path={tmp_path}/corpus.txt"], "dataset_type=synthetic does not read it"),
        (["eval_split_fraction=2"], "eval_split_fraction=2 must be between 0 and 1"),
        (["eval_split_fraction=-0.5"], "eval_split_fraction=-0.5 must be between 0 and 1"),
        # Refused at the first step before, after the run directory was made.
        (["num_moe_token_chunks=65"], "num_moe_token_chunks=65 exceeds the 64 tokens"),
    ]
    short = tmp_path / "short.txt"
    short.write_text("a few bytes")
    cases.append((["dataset_type=text", f"dataset_path={short}", "vocab_size=256"],
                  "shorter than one sequence"))
    for flags, needle in cases:
        p = train(fp8moe_bin, tmp_path, "bad", "steps=2", *flags)
        assert p.returncode == 2, (flags, p.returncode, p.stderr)
        assert needle in p.stderr, (flags, p.stderr)
        assert "Traceback" not in p.stderr and "Aborted" not in p.stderr
    # The shortest text the split takes is the size the refusal names (it
    # named 180 bytes where 171 train, with S=16 and a 0.1 eval share).
    text = (tmp_path / "corpus.txt")
    text.write_bytes(b"abcdefghij" * 10)
    p = train(fp8moe_bin, tmp_path, "short", "steps=1", "dataset_type=text", "vocab_size=256",
              f"dataset_path={text}", "max_target_length=16", "eval_split_fraction=0.1")
    assert p.returncode == 2 and "needs at least " in p.stderr, p.stderr
    least = int(p.stderr.split("needs at least ")[1].split()[0])
    for size, code in ((least - 1, 2), (least, 0)):
        text.write_bytes((b"abcdefghij" * 40)[:size])
        p = train(fp8moe_bin, tmp_path, f"short{size}", "steps=1", "dataset_type=text",
                  "vocab_size=256", f"dataset_path={text}", "max_target_length=16",
                  "eval_split_fraction=0.1")
        assert p.returncode == code, (size, p.stderr)
    p = subprocess.run([fp8moe_bin, "train", "--print-base-config", "steps=5"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "takes no config file or flags" in p.stderr, p.stderr
    # A checkpoint of another model shape.
    assert train(fp8moe_bin, tmp_path, "shape", "steps=2").returncode == 0
    p = train(fp8moe_bin, tmp_path, "shape", "steps=4", "base_moe_mlp_dim=24")
    assert p.returncode == 2 and "holds a model of shape" in p.stderr, p.stderr
    # A diverging run stops after max_nonfinite_steps skipped steps.
    p = train(fp8moe_bin, tmp_path, "nan", "steps=20", "learning_rate=1e30", "warmup_steps_fraction=0",
              "gradient_clipping_threshold=0", "max_nonfinite_steps=2")
    assert p.returncode == 2, p.stderr
    assert "non-finite" in p.stderr and "max_nonfinite_steps=2" in p.stderr, p.stderr


def test_text_data_trains_and_report_draws_a_png(fp8moe_bin, tmp_path):
    text = pathlib.Path("/usr/share/common-licenses/GPL-3")
    assert text.exists()
    p = train(fp8moe_bin, tmp_path, "text", "dataset_type=text", f"dataset_path={text}",
              "vocab_size=256", "steps=30", "eval_interval=10", "learning_rate=0.01")
    assert p.returncode == 0, p.stderr
    assert "final eval loss" in p.stdout
    lines = (tmp_path / "text" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 30
    q = train(fp8moe_bin, tmp_path, "syn", "steps=20", "eval_interval=5")
    assert q.returncode == 0, q.stderr
    out = tmp_path / "report.png"
    r = subprocess.run([fp8moe_bin, "report", str(tmp_path / "syn"), str(tmp_path / "text"),
                        "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1600, 1100)
    assert len(data) > 30000, len(data)  # four panels of curves, not a blank image
    r = subprocess.run([fp8moe_bin, "report", str(tmp_path / "nothing")], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "metrics.jsonl" in r.stderr


def test_report_draws_the_router_bias_of_a_routed_bias_run(fp8moe_bin, tmp_path):
    """routed_bias: metrics.jsonl has every MoE layer's bias at the log steps, and the
    report adds a third row (a curve per expert of the first MoE layer; the load imbalance of
    every run: drawn here with a run without the bias beside it)."""
    p = train(fp8moe_bin, tmp_path, "bias", "steps=10", "log_period=2",
              "routed_score_func=sigmoid", "routed_bias=true", "routed_bias_update_rate=0.01",
              "first_num_dense_layers=1", "base_num_decoder_layers=3", "base_mlp_dim=16")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(l) for l in (tmp_path / "bias" / "metrics.jsonl").read_text().splitlines()]
    logged = [l for l in lines if "router_bias" in l]
    assert [l["step"] for l in logged] == [2, 4, 6, 8, 10]
    for l in logged:
        assert l["router_bias"][0] == []  # the dense layer has none
        assert [len(b) for b in l["router_bias"][1:]] == [4, 4]
    assert any(b != 0 for b in logged[-1]["router_bias"][1])
    out = tmp_path / "report.png"
    q = train(fp8moe_bin, tmp_path, "nobias", "steps=10", "log_period=2",
              "routed_score_func=sigmoid", "first_num_dense_layers=1",
              "base_num_decoder_layers=3", "base_mlp_dim=16")
    assert q.returncode == 0, q.stderr
    r = subprocess.run([fp8moe_bin, "report", str(tmp_path / "bias"), str(tmp_path / "nobias"),
                        "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1600, 1650)


def test_threads_follow_the_other_processes_load(fp8moe_bin, tmp_path):
    """On two CPUs, one of them kept busy by another process, the trainer drops to one
    thread once it has measured that (metrics.jsonl `threads`, summary.json
    threads_min/max); with OMP_DYNAMIC set, OpenMP's count stays."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert len(cpus) == 2, "this test needs two CPUs"
    # taskset (util-linux), not preexec_fn: pytest has JAX's threads, and a
    # fork that runs Python code before exec can deadlock.
    pin = lambda cs: ["taskset", "-c", ",".join(str(c) for c in cs)]
    busy = subprocess.Popen(pin(cpus[:1]) + ["python3", "-c", "while True: pass"])
    try:
        runs = {}
        for name, dynamic in (("follow", None), ("fixed", "false")):
            env = dict(os.environ, OMP_NUM_THREADS="2")
            env.pop("OMP_DYNAMIC", None)
            if dynamic is not None:
                env["OMP_DYNAMIC"] = dynamic
            # The default model: ~1.5-3 s, several half-second windows.
            cmd = [fp8moe_bin, "train", f"base_output_directory={tmp_path}", f"run_name={name}",
                   "steps=80", "eval_interval=0", "eval_steps=1", "enable_checkpointing=false"]
            r = subprocess.run(pin(cpus) + cmd, capture_output=True, text=True, timeout=300,
                               env=env)
            assert r.returncode == 0, r.stderr
            steps = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            summary = json.loads((tmp_path / name / "summary.json").read_text())
            runs[name] = ([s["threads"] for s in steps], summary, r.stdout)
    finally:
        busy.kill()
        busy.wait()
    threads, summary, out = runs["follow"]
    assert threads[0] == 2 and summary["threads_max"] == 2, threads
    assert summary["threads_min"] == 1 and threads[-1] == 1, threads
    assert "threads          1-2" in out, out
    threads, summary, out = runs["fixed"]
    assert set(threads) == {2} and summary["threads_min"] == summary["threads_max"] == 2, threads


def test_resume_refuses_another_scheme_and_warns_of_changed_settings(fp8moe_bin, tmp_path):
    """A resume is the run its checkpoint began: another QAT scheme is refused
    (int8 and nanoo_fp8 share the mode name hand_crafted, and a resume used to
    take one for the other); other changed settings are a warning naming each
    (they used to pass without a word) and are listed in summary.json."""
    off = ["fp8_moe_fake_quant=false", "fp8_fake_quant_hoist=", "fp8_moe_native_fwd=false",
           "fp8_moe_native_bwd_dlhs=false"]
    p = train(fp8moe_bin, tmp_path, "r", "steps=10", "checkpoint_period=5", *off,
              "quantization=int8")
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["quantization_mode"] == "hand_crafted int8" and summary["resume_changes"] == []
    before = (tmp_path / "r" / "metrics.jsonl").read_bytes()
    p = train(fp8moe_bin, tmp_path, "r", "steps=12", *off, "quantization=nanoo_fp8")
    assert p.returncode == 2, p.stderr
    assert "quantization=int8" in p.stderr and "quantization=nanoo_fp8" in p.stderr, p.stderr
    assert (tmp_path / "r" / "metrics.jsonl").read_bytes() == before
    # Same scheme, other settings: resumes, and says what changed.
    p = train(fp8moe_bin, tmp_path, "r", "steps=12", "checkpoint_period=5", *off,
              "quantization=int8", "learning_rate=0.0005", "data_shuffle_seed=5",
              "eval_interval=3")
    assert p.returncode == 0, p.stderr
    assert "resumed from step 10" in p.stdout
    assert "warning: resuming" in p.stderr and "3 settings changed" in p.stderr, p.stderr
    assert "steps: 10 -> 12 (the learning-rate schedule follows the new steps)" in p.stderr
    assert "learning_rate: 0.003 -> 0.0005" in p.stderr and "data_shuffle_seed: 0 -> 5" in p.stderr
    assert "eval_interval" not in p.stderr  # bookkeeping: not a change of what is trained
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert {c["key"] for c in summary["resume_changes"]} == {"steps", "learning_rate",
                                                            "data_shuffle_seed"}


def test_checkpointing_off_over_a_checkpointed_run_is_refused(fp8moe_bin, tmp_path):
    """enable_checkpointing=false over a run with checkpoints used to train it
    again from step 0 over its metrics.jsonl; the next resume then mixed the
    two runs' lines."""
    p = train(fp8moe_bin, tmp_path, "d", "steps=10", "checkpoint_period=5")
    assert p.returncode == 0, p.stderr
    before = {f.name: f.read_bytes() for f in (tmp_path / "d").rglob("*") if f.is_file()
              and f.name != "train.lock"}
    p = train(fp8moe_bin, tmp_path, "d", "steps=12", "enable_checkpointing=false")
    assert p.returncode == 2 and "holds checkpoints" in p.stderr, p.stderr
    assert "enable_checkpointing=true" in p.stderr and "another run_name" in p.stderr
    after = {f.name: f.read_bytes() for f in (tmp_path / "d").rglob("*") if f.is_file()
             and f.name != "train.lock"}
    assert after == before
    # A run that never saved a checkpoint may be run again without them.
    for _ in range(2):
        p = train(fp8moe_bin, tmp_path, "n", "steps=3", "enable_checkpointing=false")
        assert p.returncode == 0, p.stderr
