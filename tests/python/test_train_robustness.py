"""`fp8moe train` as a hostile user runs it (docs/robustness.md): every flag
with bad values, a model too large for the memory cap, datasets that are not
files, checkpoints mutated at random (each resume must exit 2 naming the file
and leave it byte for byte as it was), and mpirun with several ranks (one run, written once).
Every run has a timeout, so a hang fails the test instead of stalling CI."""
import os
import pathlib
import random
import shutil
import struct
import subprocess

import pytest

import st

TINY = ["base_emb_dim=16", "base_num_decoder_layers=2", "base_num_query_heads=2", "head_dim=8",
        "base_moe_mlp_dim=16", "max_target_length=16", "per_device_batch_size=4", "vocab_size=40",
        "synthetic_alphabet_size=8", "eval_steps=2", "log_period=5"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def train(fp8moe_bin, out, name, *flags, timeout=60, env=ENV):
    cmd = [fp8moe_bin, "train", f"base_output_directory={out}", f"run_name={name}", *TINY, *flags]
    return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout,
                          env=env)


# (flags, a phrase the message must hold: the flag's name at least)
BAD_FLAGS = [
    (["steps=0"], "steps=0"), (["steps=-5"], "steps=-5"), (["steps=1e3"], "'steps'"),
    (["steps=99999999999999999999"], "'steps'"), (["steps="], "'steps'"),
    (["learning_rate=nan"], "learning_rate"), (["learning_rate=inf"], "learning_rate"),
    (["learning_rate=-1"], "learning_rate"), (["learning_rate=abc"], "learning_rate"),
    # Rounded to 0 in the float32 update: 0 / 0 made the weights NaN, and the
    # run ended with exit 0, a NaN eval loss and a NaN checkpoint.
    (["adam_eps=1e-300"], "adam_eps"),
    (["adam_b1=1"], "adam_b1"), (["adam_b2=-0.1"], "adam_b2"), (["adam_eps=0"], "adam_eps"),
    (["adam_weight_decay=-1"], "adam_weight_decay"),
    (["warmup_steps_fraction=2"], "warmup_steps_fraction"),
    (["cosine_learning_rate_final_fraction=-1"], "cosine_learning_rate_final_fraction"),
    (["gradient_clipping_threshold=-1"], "gradient_clipping_threshold"),
    (["max_nonfinite_steps=-1"], "max_nonfinite_steps"),
    (["checkpoint_period=-1"], "checkpoint_period"), (["log_period=0"], "log_period"),
    (["eval_interval=-1"], "eval_interval"), (["eval_steps=0"], "eval_steps"),
    (["eval_steps=4611686018427387904"], "eval_steps"),
    (["init_weights_seed=-1"], "init_weights_seed"), (["data_shuffle_seed=-1"], "data_shuffle_seed"),
    (["enable_checkpointing=maybe"], "enable_checkpointing"),
    (["run_name=a/b"], "run_name"), (["run_name=.."], "run_name"), (["run_name=."], "run_name"),
    (["run_name="], "run_name"), (["run_name=a\nb"], "run_name"), (["run_name=" + "x" * 300], "run_name"), (["base_output_directory="], "base_output_directory"),
    (["vocab_size=0"], "vocab_size"), (["vocab_size=4294967296"], "vocab_size"),
    (["base_emb_dim=-1"], "base_emb_dim"), (["base_num_decoder_layers=1000000000000"],
                                             "base_num_decoder_layers"),
    (["base_num_query_heads=4611686018427387904"], "base_num_query_heads"),
    (["head_dim=4611686018427387904"], "head_dim"), (["head_dim=7"], "head_dim=7"),
    (["base_moe_mlp_dim=2000000000"], "base_moe_mlp_dim"),
    # The product wrapped past 2^64 and the run segfaulted.
    (["per_device_batch_size=4611686018427387904", "max_target_length=4"], "per_device_batch_size"),
    (["per_device_batch_size=1000000", "max_target_length=100000"], "per_device_batch_size"),
    (["rope_max_timescale=1"], "rope_max_timescale"),
    (["normalization_layer_epsilon=0"], "normalization_layer_epsilon"),
    (["num_experts=0"], "num_experts"), (["num_experts=100000000000"], "num_experts"),
    (["num_experts_per_tok=5"], "num_experts_per_tok"),
    (["ragged_buffer_factor=1e300"], "ragged_buffer_factor"),
    (["wi_tile_fwd_batch_seq=9223372036854775807"], "wi_tile_fwd_batch_seq"),
    (["quantization=fp8"], "quantization"), (["dtype=float16"], "dtype"),
    (["sparse_matmul=false"], "sparse_matmul"), (["capacity_factor=1"], "capacity_factor"),
    (["ici_tensor_parallelism=2"], "ici_tensor_parallelism"),
    (["synthetic_num_sources=0"], "synthetic_num_sources"),
    (["synthetic_alphabet_size=1"], "synthetic_alphabet_size"),
    (["synthetic_num_sources=9223372036854775807", "synthetic_alphabet_size=9223372036854775807"],
     "synthetic"),
    # Hung before (a loop of branching draws per symbol).
    (["synthetic_branching=1000000000000"], "synthetic_branching"),
    (["dataset_type=csv"], "dataset_type"), (["dataset_type=text"], "dataset_path"),
    (["dataset_type=tokens"], "dataset_type=tokens needs dataset_path=FILE"),
    (["dataset_type=tokens", "dataset_path=/no/such.tok"], "cannot read dataset_path '/no/such.tok'"),
    (["dataset_type=text", "vocab_size=40", "dataset_path=/etc/hostname"], "vocab_size"),
    (["dataset_type=text", "vocab_size=256", "dataset_path=/etc/hostname", "eval_split_fraction=1"],
     "eval_split_fraction"),
    (["nosuchkey=1"], "nosuchkey"), (["stpes=10"], "did you mean 'steps'"), (["steps"], "steps"),
    # The FFN variants (issue 36).
    (["shared_experts=-1"], "shared_experts=-1"),
    (["shared_experts=1000000000"], "shared_experts x base_moe_mlp_dim"),
    (["first_num_dense_layers=3"], "first_num_dense_layers=3 is outside"),
    (["first_num_dense_layers=-1"], "first_num_dense_layers=-1"),
    (["base_mlp_dim=0"], "base_mlp_dim=0"),
    (["first_num_dense_layers=2", "shared_experts=1"], "MoE-only flags are set: shared_experts=1"),
    # The trainer's default QAT mode is native FP8: an all-dense model must unset it.
    (["first_num_dense_layers=2"], "a QAT mode of the routed experts"),
    # Auxiliary-loss-free balancing (issue 36): the rate needs the bias, the bias sigmoid
    # scores, and an all-dense model has no router to bias.
    (["routed_bias_update_rate=0.001"],
     "routed_bias_update_rate=0.001 is set but routed_bias=false"),
    (["routed_bias_update_rate=-1"], "routed_bias_update_rate=-1 must be a finite number"),
    (["routed_score_func=sigmoid", "routed_bias=true", "routed_bias_update_rate=1e39"],
     "routed_bias_update_rate=1e+39 is outside float32's range"),
    (["routed_bias=true"], "routed_bias=true biases the sigmoid scores"),
    (["first_num_dense_layers=2", "routed_score_func=sigmoid", "routed_bias=true"],
     "MoE-only flags are set: routed_bias=true"),
    # Multi-head latent attention (issue 36).
    (["attention_type=local_sliding"], "attention_type=local_sliding is not implemented"),
    (["attention_type=mla", "kv_lora_rank=0"], "kv_lora_rank=0 must be in [1, 2^31)"),
    (["attention_type=mla", "qk_nope_head_dim=0"], "qk_nope_head_dim=0"),
    (["attention_type=mla", "qk_rope_head_dim=-2"], "qk_rope_head_dim=-2"),
    (["attention_type=mla", "qk_rope_head_dim=7"], "qk_rope_head_dim=7 is odd"),
    (["attention_type=mla", "v_head_dim=0"], "v_head_dim=0"),
    (["attention_type=mla", "q_lora_rank=-1"], "q_lora_rank=-1"),
    (["attention_type=mla", "base_num_kv_heads=1"], "base_num_kv_heads=1 with attention_type=mla"),
    (["attention_type=mla", "use_qk_norm=true"], "use_qk_norm=true with attention_type=mla"),
    (["kv_lora_rank=-1"], "kv_lora_rank=-1 is negative"),
    (["rope_type=yarn"], "YaRN RoPE scaling is not implemented yet"),
    (["rope_type=llama3.1"], "rope_type=llama3.1 is not implemented"),
]


@pytest.mark.parametrize("flags,needle", BAD_FLAGS, ids=[" ".join(f)[:60] for f, _ in BAD_FLAGS])
def test_bad_flags_exit_2_naming_the_flag(fp8moe_bin, tmp_path, flags, needle):
    p = train(fp8moe_bin, tmp_path, "bad", "steps=2", *flags)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stderr.startswith("error: "), p.stderr[-2000:]
    assert needle in p.stderr, p.stderr
    # A refused run leaves no run directory behind.
    assert not (tmp_path / "bad").exists()


def test_bad_config_files_exit_2(fp8moe_bin, tmp_path):
    cases = {
        "missing.yml": None,
        "list.yml": "- a\n- b\n",
        "nested.yml": "steps:\n  a: 1\n",
        "dup.yml": "steps: 2\nsteps: 3\n",
        "unknown.yml": "stpes: 2\n",
        "binary.yml": b"\xff\xfe\x00steps: 2\n",
        "two.yml": "steps: 2\n---\nsteps: 3\n",
    }
    for name, text in cases.items():
        path = tmp_path / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        elif text is not None:
            path.write_text(text)
        cmd = [fp8moe_bin, "train", str(path), f"base_output_directory={tmp_path}", "run_name=cfg"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ENV)
        assert p.returncode == 2, (name, p.returncode, p.stderr)
        assert p.stderr.startswith("error: ") and name in p.stderr, (name, p.stderr)
    # A directory given as the config file.
    p = subprocess.run([fp8moe_bin, "train", str(tmp_path), f"base_output_directory={tmp_path}"],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert p.returncode == 2, p.stderr


def test_a_model_over_the_memory_cap_is_refused_up_front(fp8moe_bin, tmp_path):
    env = dict(ENV, FP8MOE_MEMORY_CAP="1G")
    for flags in (["base_emb_dim=100000", "num_experts=1000"], ["vocab_size=2000000000"],
                  ["base_num_decoder_layers=100000000"],
                  ["per_device_batch_size=100000", "max_target_length=1000"]):
        p = train(fp8moe_bin, tmp_path, "huge", *flags, env=env)
        assert p.returncode == 2, (flags, p.returncode, p.stderr)
        assert "this training run" in p.stderr and "memory cap is 1073741824 bytes" in p.stderr, p.stderr
        assert not (tmp_path / "huge").exists()


def test_unwritable_or_odd_output_directories_exit_2(fp8moe_bin, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    p = train(fp8moe_bin, afile, "r", "steps=2")
    assert p.returncode == 2 and "cannot create the run directory" in p.stderr, p.stderr
    # checkpoints/ is a file.
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / "checkpoints").write_text("x")
    p = train(fp8moe_bin, tmp_path, "r2", "steps=2")
    assert p.returncode == 2 and "cannot create the run directory" in p.stderr, p.stderr
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        p = train(fp8moe_bin, ro, "r", "steps=2")
        assert p.returncode == 2, p.stderr


def test_datasets_that_are_not_regular_files_exit_2(fp8moe_bin, tmp_path):
    # A directory made the reader throw (abort, exit 134); /dev/zero never ends.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, needle in ((tmp_path, "a directory"), ("/dev/zero", "not a regular file"),
                         (fifo, "not a regular file"), (tmp_path / "none", "cannot read")):
        p = train(fp8moe_bin, tmp_path, "text", "steps=2", "dataset_type=text", "vocab_size=256",
                  f"dataset_path={path}", timeout=30)
        assert p.returncode == 2, (path, p.returncode, p.stderr)
        assert needle in p.stderr, p.stderr
    # Bytes that are not UTF-8 are still bytes: tokens 0..255, trained on.
    data = tmp_path / "binary.bin"
    data.write_bytes(bytes(random.Random(1).randrange(256) for _ in range(4000)))
    p = train(fp8moe_bin, tmp_path, "binary", "steps=2", "dataset_type=text", "vocab_size=256",
              f"dataset_path={data}")
    assert p.returncode == 0, p.stderr


def token_file(vocab=40, eos=0, docs=None, width=None, version=1, magic=b"FP8MTOKS"):
    """A token file by docs/train.md's table (header, offsets, ids; each
    document ends with EOS): 20 documents of 9 ids + EOS by default."""
    docs = docs if docs is not None else [[1 + (d + i) % 30 for i in range(9)] for d in range(20)]
    ids, offs = [], [0]
    for d in docs:
        ids += d + [eos]
        offs.append(len(ids))
    width = width or (2 if vocab <= 65536 else 4)
    return (struct.pack("<8sIIQQQQ", magic, version, width, vocab, eos, len(docs), len(ids)) +
            struct.pack(f"<{len(offs)}Q", *offs) +
            struct.pack(f"<{len(ids)}{'H' if width == 2 else 'I'}", *ids))


GOOD_TOKENS = token_file()
# (name, the file's bytes, phrases the message must hold: the numbers)
BAD_TOKEN_FILES = [
    ("magic", token_file(magic=b"GGUF\0\0\0\0"), ["is not a token file"]),
    ("text", b"hello world\n" * 40, ["is not a token file"]),
    ("version", token_file(version=7), ["token file version 7", "reads version 1"]),
    ("truncated", GOOD_TOKENS[:-3],
     [f"has {len(GOOD_TOKENS) - 3} bytes", f"makes it {len(GOOD_TOKENS)} bytes",
      "the file is truncated"]),
    ("header cut", GOOD_TOKENS[:20], ["has 20 bytes, fewer than the 48-byte header"]),
    ("width", token_file(width=4), ["stores ids in 4 bytes, but its vocab_size 40 takes 2"]),
    ("vocab", token_file(vocab=41), ["a vocabulary of 41 ids but the model's vocab_size=40",
                                     "set vocab_size=41"]),
    ("eos", token_file(eos=40), ["EOS id 40 outside its vocabulary of 40"]),
    ("id", token_file(docs=[[1, 2, 39]] * 10 + [[1, 45, 2]] + [[3] * 9] * 9),
     ["id 41 is 45, outside its vocabulary of 40"]),
    ("split", token_file(docs=[[1, 2]] * 5), ["each split needs one document and "
                                              "max_target_length + 1 = 17 tokens"]),
]


@pytest.mark.parametrize("name,data,needles", BAD_TOKEN_FILES, ids=[c[0] for c in BAD_TOKEN_FILES])
def test_bad_token_files_exit_2_naming_the_file_and_the_numbers(fp8moe_bin, tmp_path, name,
                                                                data, needles):
    path = tmp_path / "corpus.tok"
    path.write_bytes(data)
    p = train(fp8moe_bin, tmp_path, "bad", "steps=2", "dataset_type=tokens",
              f"dataset_path={path}")
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stderr.startswith("error: "), p.stderr[-2000:]
    assert str(path) in p.stderr, p.stderr
    for needle in needles:
        assert needle in p.stderr, p.stderr
    assert not (tmp_path / "bad").exists()
    # The good file trains.
    path.write_bytes(GOOD_TOKENS)
    p = train(fp8moe_bin, tmp_path, "good", "steps=2", "dataset_type=tokens",
              f"dataset_path={path}")
    assert p.returncode == 0, p.stderr


def tiny_checkpoint(fp8moe_bin, out):
    """A run of 4 steps with its checkpoint at step 4 (the seed of the campaign)."""
    p = train(fp8moe_bin, out, "seed", "steps=4", "checkpoint_period=4", "eval_interval=0")
    assert p.returncode == 0, p.stderr
    return out / "seed" / "checkpoints" / "step_00000004.safetensors"


def mutate(data, rng):
    b = bytearray(data)
    kind = rng.choice(["flip", "flips", "truncate", "extend", "zero", "splice", "header"])
    if kind == "flip":
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif kind == "flips":
        for _ in range(rng.randrange(2, 50)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == "truncate":
        del b[rng.randrange(len(b)):]
    elif kind == "extend":
        b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif kind == "zero":
        i = rng.randrange(len(b))
        n = len(b[i:i + rng.randrange(1, 4096)])
        b[i:i + n] = bytes(n)
    elif kind == "splice":
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        b = b[:i] + b[j:]
    else:  # inside the JSON header: digits, quotes, braces
        n = int.from_bytes(b[:8], "little") if len(b) >= 8 else 0
        if 8 < n + 8 <= len(b):
            i = rng.randrange(8, 8 + n)
            b[i] = ord(rng.choice('0123456789",:{}[]-.e '))
    return bytes(b), kind


def test_random_mutations_of_a_checkpoint_are_refused_and_left_alone(fp8moe_bin, tmp_path):
    """Each mutated checkpoint is put in a fresh run directory and resumed:
    exit 2, an error naming the file, the file unchanged, no new checkpoint.
    A mutation the reader cannot see (none should pass the checksum) would
    resume and exit 0: that fails the test."""
    ckpt = tiny_checkpoint(fp8moe_bin, tmp_path)
    original = ckpt.read_bytes()
    rng = random.Random(int(os.environ.get("FP8MOE_TEST_SEED", "11")))
    kinds = {}
    for i in range(int(os.environ.get("FP8MOE_CHECKPOINT_MUTATIONS", "60"))):
        data, kind = mutate(original, rng)
        if data == original:
            continue
        run = tmp_path / f"m{i}"
        (run / "checkpoints").mkdir(parents=True)
        target = run / "checkpoints" / ckpt.name
        target.write_bytes(data)
        p = train(fp8moe_bin, tmp_path, f"m{i}", "steps=8", "checkpoint_period=4",
                  "eval_interval=0", timeout=60)
        assert p.returncode == 2, (i, kind, p.returncode, p.stderr[-2000:])
        assert p.stderr.startswith("error: ") and ckpt.name in p.stderr, (kind, p.stderr)
        # Printable: the JSON parser's quote of the damaged bytes was raw binary.
        assert "\ufffd" not in p.stderr, (kind, p.stderr[:600])
        assert target.read_bytes() == data, (i, kind, "the checkpoint was changed")
        assert sorted(os.listdir(run / "checkpoints")) == [ckpt.name], (i, kind)
        kinds[kind] = kinds.get(kind, 0) + 1
        shutil.rmtree(run)
    assert len(kinds) >= 5, kinds


def test_checkpoint_of_another_config_or_a_future_step_exits_2(fp8moe_bin, tmp_path):
    tiny_checkpoint(fp8moe_bin, tmp_path)
    for flags, needle in ((["steps=8", "base_moe_mlp_dim=24"], "holds a model of shape"),
                          # the FFN variants: the signature names the flag
                          (["steps=8", "shared_experts=1"], "shared_experts=1"),
                          (["steps=8", "first_num_dense_layers=1"], "first_num_dense_layers=1"),
                          (["steps=8", "base_num_kv_heads=1"], "base_num_kv_heads=1"),
                          (["steps=8", "logits_via_embedding=true"], "logits_via_embedding=true"),
                          (["steps=8", "use_qk_norm=true"], "use_qk_norm=true"),
                          (["steps=8", "attention_type=mla", "kv_lora_rank=8",
                            "qk_nope_head_dim=8", "qk_rope_head_dim=4", "v_head_dim=8"],
                           "attention_type=mla"),
                          (["steps=8", "fp8_moe_native_bwd_dlhs=false"], "QAT mode"),
                          (["steps=2"], "past this run's steps=2")):
        before = {c.name: c.read_bytes() for c in (tmp_path / "seed" / "checkpoints").iterdir()}
        p = train(fp8moe_bin, tmp_path, "seed", *flags)
        assert p.returncode == 2 and needle in p.stderr, (flags, p.returncode, p.stderr)
        after = {c.name: c.read_bytes() for c in (tmp_path / "seed" / "checkpoints").iterdir()}
        assert after == before


def test_a_checkpoint_rewritten_with_other_shapes_is_refused(fp8moe_bin, tmp_path):
    """A well-formed safetensors file with fp8moe's metadata but a wrong
    tensor: caught by the checksum (the file was edited after fp8moe wrote it)."""
    ckpt = tiny_checkpoint(fp8moe_bin, tmp_path)
    tensors = st.read(ckpt)
    meta = st.read_metadata(ckpt)
    assert "checksum" in meta and meta["fp8moe_checkpoint"] == "1"
    tensors["params/embed"] = tensors["params/embed"][:, :8].copy()
    st.write(ckpt, tensors, meta)
    p = train(fp8moe_bin, tmp_path, "seed", "steps=8")
    assert p.returncode == 2 and ckpt.name in p.stderr and "is corrupt" in p.stderr, p.stderr


MPI = shutil.which("mpirun")


@pytest.mark.skipif(MPI is None, reason="no mpirun on this machine")
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpirun_ranks_write_one_run_once(fp8moe_bin, tmp_path, ranks):
    """Under mpirun the ranks train one run (FSDP): rank 0 alone holds the run
    lock and writes, so metrics.jsonl has every logged step once and the
    summary and checkpoints are one rank's; the global batch is
    per_device_batch_size x the ranks. A per_device_batch_size whose global
    batch is not a whole number is refused on every rank, with nothing
    written."""
    import json
    env = dict(ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    batch = 6 if ranks == 3 else 4
    cmd = [MPI, "-np", str(ranks), "--oversubscribe", fp8moe_bin, "train",
           f"base_output_directory={tmp_path}", "run_name=mpi",
           *[f for f in TINY if not f.startswith(("log_period=", "per_device_batch_size="))],
           "steps=4",
           "log_period=1", f"per_device_batch_size={batch}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    steps = [json.loads(line)["step"] for line in (tmp_path / "mpi" / "metrics.jsonl").open()]
    assert steps == sorted(set(steps)) and steps[-1] == 4, steps
    summary = json.loads((tmp_path / "mpi" / "summary.json").read_text())
    assert summary["global_batch_size_to_train_on"] == batch * ranks, summary
    # 1.25 x 2 = 2.5 and 1.25 x 3 = 3.75 sequences.
    cmd[cmd.index(f"per_device_batch_size={batch}")] = "per_device_batch_size=1.25"
    cmd[cmd.index("run_name=mpi")] = "run_name=uneven"
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stderr.count(f"per_device_batch_size=1.25 on {ranks} ranks is a global batch "
                          "(global_batch_size_to_train_on) of ") == ranks, p.stderr
    assert p.stderr.count("not a whole number") == ranks, p.stderr
    assert not (tmp_path / "uneven").exists()


def test_a_second_trainer_on_the_same_run_is_refused(fp8moe_bin, tmp_path):
    """Two processes resuming one run both appended every step to
    metrics.jsonl and raced on the checkpoints; the second is refused now,
    and the lock dies with the first (SIGKILL included)."""
    import signal
    import time
    cmd = [fp8moe_bin, "train", f"base_output_directory={tmp_path}", "run_name=shared", *TINY,
           "steps=100000", "checkpoint_period=50", "eval_interval=0"]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        metrics = tmp_path / "shared" / "metrics.jsonl"
        deadline = time.time() + 60
        while time.time() < deadline and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.05)
        assert first.poll() is None
        p = train(fp8moe_bin, tmp_path, "shared", "steps=100000")
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert "is in use by another fp8moe train" in p.stderr, p.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    p = train(fp8moe_bin, tmp_path, "shared", "steps=2")
    assert p.returncode in (0, 2), p.stderr  # 2: the checkpoint is past steps=2
    assert "in use" not in p.stderr, p.stderr


@pytest.mark.parametrize("flag", ["learning_rate=1e308", "adam_weight_decay=1e38"])
def test_an_update_that_makes_the_weights_non_finite_stops_the_run(fp8moe_bin, tmp_path, flag):
    """Finite gradients, non-finite weights after the update: the run went on
    with NaN weights (every later step skipped), exited 0 and saved them."""
    ok = train(fp8moe_bin, tmp_path, "nan", "steps=2", "checkpoint_period=2", "eval_interval=0")
    assert ok.returncode == 0, ok.stderr
    before = {c.name: c.read_bytes() for c in (tmp_path / "nan" / "checkpoints").iterdir()}
    p = train(fp8moe_bin, tmp_path, "nan", "steps=4", "checkpoint_period=1", flag)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "made the weights of" in p.stderr and "non-finite" in p.stderr, p.stderr
    after = {c.name: c.read_bytes() for c in (tmp_path / "nan" / "checkpoints").iterdir()}
    assert after == before  # no checkpoint of NaN weights
