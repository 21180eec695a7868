"""python -m fp8moe.data (encode / decode, the token file of docs/train.md's
Data section) with tiny tokenizers the tests train themselves (no downloads):
a byte-level BPE of the `tokenizers` package and a byte-fallback BPE of
`sentencepiece`, both lossless, so text -> ids -> text gives the input back.
The file is read here by an independent struct parser of the documented
layout, and `fp8moe train dataset_type=tokens` trains on it and resumes with
the bits of an uninterrupted run."""
import io
import json
import math
import os
import shutil
import struct
import subprocess
import sys

import pytest

import fp8moe.data as fd
import st

# Paragraphs in the normal form split_documents/join_documents invert: one
# blank line between paragraphs, a final newline; non-ASCII on purpose.
PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog.\nIt was not amused.",
    "Naïve café owners in Zürich — and 東京 — serve crème brûlée at 3:14 pm.",
    "Mixture-of-experts models route each token to a few experts;\n"
    "the router's choice is discrete, so balance needs help.",
    "  Leading spaces, trailing tabs\t and    runs of spaces survive a lossless tokenizer.",
    "FP8 e4m3 holds 448 at most; e5m2 trades a mantissa bit for range.",
]
TEXT = "\n\n".join(PARAGRAPHS) + "\n"
TINY = ["base_emb_dim=16", "base_num_decoder_layers=2", "base_num_query_heads=2", "head_dim=8",
        "base_moe_mlp_dim=16", "max_target_length=16", "per_device_batch_size=4",
        "eval_steps=2", "log_period=1"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def corpus_lines(n=200):
    """Training text for the tokenizers: the paragraphs' lines, varied."""
    base = [l for p in PARAGRAPHS for l in p.split("\n")]
    return [f"{base[i % len(base)]} {i} {base[(7 * i) % len(base)][::-1]}" for i in range(n)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    d = tmp_path_factory.mktemp("hf")
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("sp")
    (d / "train.txt").write_text("\n".join(corpus_lines()) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(d / "train.txt"), model_prefix=str(d / "tiny"), vocab_size=400,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, minloglevel=2)
    return d / "tiny.model"


def data_cli(*args):
    return subprocess.run([sys.executable, "-m", "fp8moe.data", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def parse(path):
    """The token file by the table of docs/train.md, independently of fd."""
    b = path.read_bytes()
    magic, version, width, vocab, eos, ndocs, ntok = struct.unpack_from("<8sIIQQQQ", b)
    assert (magic, version) == (b"FP8MTOKS", 1)
    assert width == (2 if vocab <= 65536 else 4)
    assert len(b) == 48 + 8 * (ndocs + 1) + width * ntok
    offs = struct.unpack_from(f"<{ndocs + 1}Q", b, 48)
    ids = struct.unpack_from(f"<{ntok}{'H' if width == 2 else 'I'}", b, 48 + 8 * (ndocs + 1))
    return vocab, eos, [list(ids[offs[d]:offs[d + 1]]) for d in range(ndocs)]


@pytest.mark.parametrize("split", ["paragraph", "line", "file"])
@pytest.mark.parametrize("kind", ["huggingface", "sentencepiece"])
def test_encode_decode_round_trip(kind, split, hf_dir, sp_model, tmp_path):
    path = hf_dir if kind == "huggingface" else sp_model
    text = TEXT if split != "line" else "\n".join(l for p in PARAGRAPHS for l in p.split("\n")) + "\n"
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(text, encoding="utf-8")
    b.write_text(text.upper(), encoding="utf-8")
    out = tmp_path / "c.tok"
    p = data_cli("encode", "--tokenizer", path, "--tokenizer-type", kind, "--in", a, b,
                 "--out", out, "--split", split)
    assert p.returncode == 0, p.stderr
    tok = fd.load_tokenizer(str(path), kind)
    vocab, eos, docs = parse(out)
    assert vocab == tok.vocab_size and eos == tok.eos_id
    want = fd.split_documents(text, split) + fd.split_documents(text.upper(), split)
    assert len(docs) == len(want) == {"paragraph": 10, "line": 14, "file": 2}[split]
    for d, w in zip(docs, want):
        assert d == tok.encode(w) + [eos]
        assert eos not in d[:-1]
    back = tmp_path / "back.txt"
    p = data_cli("decode", "--tokenizer", path, "--tokenizer-type", kind, "--in", out,
                 "--out", back, "--split", split)
    assert p.returncode == 0, p.stderr
    # Paragraph documents keep no file boundary: the two files' paragraphs
    # come back joined by one blank line.
    between = "\n" if split == "paragraph" else ""
    assert back.read_text(encoding="utf-8") == text + between + text.upper()


def test_bad_input_exits_2_naming_the_thing(hf_dir, tmp_path, monkeypatch, capsys):
    txt = tmp_path / "t.txt"
    txt.write_text(TEXT)
    out = tmp_path / "o.tok"
    enc = ["encode", "--tokenizer", hf_dir, "--tokenizer-type", "huggingface", "--out", out]
    cases = [
        (enc + ["--in", tmp_path / "missing.txt"], "input '" + str(tmp_path / "missing.txt")),
        (["encode", "--tokenizer", hf_dir, "--tokenizer-type", "tiktoken", "--in", txt, "--out",
          out], "invalid choice: 'tiktoken'"),
        (["encode", "--tokenizer", tmp_path / "nope", "--tokenizer-type", "huggingface", "--in",
          txt, "--out", out], "tokenizer '" + str(tmp_path / "nope")),
        (["encode", "--tokenizer", txt, "--tokenizer-type", "sentencepiece", "--in", txt,
          "--out", out], "cannot be read by sentencepiece"),
        (["decode", "--tokenizer", hf_dir, "--tokenizer-type", "huggingface", "--in", txt],
         "is not a token file"),
        (enc + ["--in", txt, "--eos-id", "100000"], "EOS id 100000 is outside the vocabulary"),
    ]
    for args, needle in cases:
        p = data_cli(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert needle in p.stderr, p.stderr
        assert not out.exists()
    # A tokenizer whose ids do not fit uint32.
    monkeypatch.setattr(fd, "_hf_tokenizer",
                        lambda path: fd.Tokenizer((1 << 32) + 1, 0, lambda s: [], lambda i: ""))
    assert fd.main(["encode", "--tokenizer", str(hf_dir), "--tokenizer-type", "huggingface",
                    "--in", str(txt), "--out", str(out)]) == 2
    assert "a vocabulary of 4294967297 ids does not fit the token file's uint32" in \
        capsys.readouterr().err
    assert not out.exists()


def test_the_package_imports_without_the_tokenizer_packages(tmp_path):
    code = ("import sys\nsys.modules['tokenizers'] = None\nsys.modules['sentencepiece'] = None\n"
            "import fp8moe.data as fd\n"
            "sys.exit(fd.main(['encode', '--tokenizer', 'x', '--tokenizer-type', 'huggingface',"
            " '--in', 'y', '--out', 'z']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "needs the `tokenizers` package: pip install tokenizers" in p.stderr


def test_eos_comes_from_tokenizer_config_json_else_the_usual_names(hf_dir, tmp_path):
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert fd.load_tokenizer(str(hf_dir), "huggingface").eos_id == ids.token_to_id("<|endoftext|>")
    d = tmp_path / "model"
    shutil.copytree(hf_dir, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    txt = tmp_path / "t.txt"
    txt.write_text(TEXT, encoding="utf-8")
    p = data_cli("encode", "--tokenizer", d, "--tokenizer-type", "huggingface", "--in", txt,
                 "--out", tmp_path / "c.tok")
    assert p.returncode == 0, p.stderr
    _, eos, docs = parse(tmp_path / "c.tok")
    assert eos == ids.token_to_id("<|im_end|>") != ids.token_to_id("<|endoftext|>")
    assert all(doc[-1] == eos for doc in docs)
    # --eos-id wins; a tokenizer that names none needs it.
    p = data_cli("encode", "--tokenizer", d, "--tokenizer-type", "huggingface", "--in", txt,
                 "--out", tmp_path / "e.tok", "--eos-id", "7")
    assert p.returncode == 0 and parse(tmp_path / "e.tok")[1] == 7, p.stderr
    tok = fd.Tokenizer(300, None, lambda s: [1], lambda i: "")
    with pytest.raises(fd.DataError, match="names no EOS token .* give --eos-id N"):
        fd.encode_files(tok, [str(txt)], str(tmp_path / "n.tok"))


def test_big_inputs_report_progress(hf_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(fd, "PROGRESS_BYTES", 100)
    txt = tmp_path / "t.txt"
    txt.write_text(TEXT, encoding="utf-8")
    log = io.StringIO()
    tok = fd.load_tokenizer(str(hf_dir), "huggingface")
    fd.encode_files(tok, [str(txt)], str(tmp_path / "o.tok"), progress=log)
    lines = log.getvalue().splitlines()
    assert len(lines) >= 3 and all(l.startswith("fp8moe.data: ") for l in lines), lines
    assert "documents" in lines[0] and lines[-1].startswith(f"fp8moe.data: wrote {tmp_path}")


def test_uint32_ids_above_65536(tmp_path):
    out = str(tmp_path / "w.tok")
    fd.write_corpus(out, [[70000, 1, 65536], [3]], vocab_size=70001, eos_id=2)
    vocab, eos, docs = parse(tmp_path / "w.tok")
    assert (vocab, eos, docs) == (70001, 2, [[70000, 1, 65536, 2], [3, 2]])
    c = fd.read_corpus(out)
    assert c.ids.dtype.itemsize == 4 and [list(d) for d in c.documents()] == docs


def same_tensors(a, b):
    """The checkpoints' tensors (weights, optimizer state, data position) are
    bit for bit the same (their metadata holds times)."""
    ta, tb = st.read(a), st.read(b)
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and ta[k].tobytes() == tb[k].tobytes() for k in ta)


def train(fp8moe_bin, out, name, *flags):
    cmd = [fp8moe_bin, "train", f"base_output_directory={out}", f"run_name={name}", *TINY, *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)


def test_encode_then_train_on_tokens_and_resume(fp8moe_bin, hf_dir, tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text("\n\n".join(corpus_lines(120)) + "\n", encoding="utf-8")
    corpus = tmp_path / "c.tok"
    p = data_cli("encode", "--tokenizer", hf_dir, "--tokenizer-type", "huggingface", "--in", txt,
                 "--out", corpus)
    assert p.returncode == 0, p.stderr
    vocab, _, docs = parse(corpus)
    assert len(docs) == 120
    flags = ["dataset_type=tokens", f"dataset_path={corpus}", f"vocab_size={vocab}"]
    p = train(fp8moe_bin, tmp_path, "three", "steps=3", *flags)
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "three" / "summary.json").read_text())
    assert math.isfinite(summary["final_eval_loss"]), summary
    assert "tokens: " + str(corpus) in p.stdout + p.stderr
    # Resume: 4 steps, checkpoint at 2, the step-4 checkpoint removed, run
    # again: the same final checkpoint bits and eval loss as uninterrupted.
    p = train(fp8moe_bin, tmp_path, "whole", "steps=4", "checkpoint_period=2", *flags)
    assert p.returncode == 0, p.stderr
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    last = "checkpoints/step_00000004.safetensors"
    (tmp_path / "cut" / last).unlink()
    p = train(fp8moe_bin, tmp_path, "cut", "steps=4", "checkpoint_period=2", *flags)
    assert p.returncode == 0, p.stderr
    assert "resumed from step 2" in p.stdout
    assert same_tensors(tmp_path / "cut" / last, tmp_path / "whole" / last)
    assert st.read_metadata(tmp_path / "cut" / last)["data_position"] == \
        st.read_metadata(tmp_path / "whole" / last)["data_position"] == "16"  # 4 steps x 4
    # And another data_shuffle_seed is another order: other bits.
    p = train(fp8moe_bin, tmp_path, "seed1", "steps=4", "data_shuffle_seed=1", *flags)
    assert p.returncode == 0, p.stderr
    assert not same_tensors(tmp_path / "seed1" / last, tmp_path / "whole" / last)
