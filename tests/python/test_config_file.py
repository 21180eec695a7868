"""Config files (docs/config.md, "Config file syntax") against an outside
oracle: PyYAML must read every file our flat reader accepts to the same string,
and every file PyYAML refuses must be refused by ours too (exit 2, naming the
line and column). The value comes back through `fp8moe train`: a string flag
with choices echoes the value it was given in its error message, exactly."""
import json
import math
import os
import re
import subprocess

import pytest

import yaml  # tests/python/requirements.txt pins it (a missing module must fail, not skip)

ENV = dict(os.environ, OMP_NUM_THREADS="1")
KEY = "bwd_quantization_dtype"  # a string flag whose choices are e5m2 and e4m3
ECHO = re.compile(r"invalid value '(.*)' for string key '" + KEY + "'", re.S)

# Values as written after "KEY: ", quoting and comments included.
VALUES = [
    # plain
    "fp8_x", "a b  c", "3e-4   ", "a # b", "a#b", "a:b", "http://x.y/z",
    "a, b]", "a&b*c !d |e", "-1", "+0.5", ".inf", "yes", "Off", "?x", ":x", "~x", "nULL",
    "r\u00e9sum\u00e9 \u20ac", "0x1F", "1_000",
    # single-quoted
    "''", "'it''s'", "''''", "'a # b'  # c", "'a\\nb'", "' pad  '", "'*x: &y [z]'", "'null'",
    # double-quoted
    '""', r'"a\"b\\c\/d"', r'"\n\t\r\a\b\v\f\e\ "', r'"\x01\x7F\u00e9\u20AC\U0001F600"',
    r'"\N\_\L\P"', '"tab\there"', '"it\'s #not a comment" # a comment', '"~"',
    # null
    "", "   # a comment", "~", "null", "Null", "NULL",
]

# Whole files around the key: comments, markers, line ends, a byte order mark.
FILES = [
    b"# c\n---\nKEY: v1 # c\n...\n# after\n",
    b"--- # c\n\n  # indented comment\nKEY: 'v 2'\n",
    b"KEY: v3\r\n",
    b"\xef\xbb\xbfKEY: v4\n",
    b"KEY : v5",
    b"KEY: 'v\t6' # \tc\n",
]

# Not YAML (PyYAML refuses each): ours must refuse too, naming line and column.
MALFORMED = [
    "KEY: a: b\n", 'KEY: "x"y\n', "KEY: 'x\n", "KEY: x\n  y: 1\n", "KEY: \"\\q\"\n",
    "KEY: *x\n", "KEY: [1, 2\n", "- a\nKEY: 1\n", "KEY: 1\n\tsteps: 2\n", "KEY: @x\n",
    # tabs outside quotes, which YAML 1.2 would take as spaces: refused too
    "KEY:\tx\n", "KEY: x\t\n", "KEY: x\t# c\n",
    "KEY: x\n\t\n", "KEY: x\n  \t# c\n", "---\t\nKEY: x\n",
]

# Valid YAML outside the subset: refused, naming line and column and the fix.
UNSUPPORTED = [
    ("KEY: &a x\n", "anchors and aliases"), ("KEY: !!str x\n", "tags are not supported"),
    ("KEY: |\n  x\n", "block scalars are not supported"), ("KEY:\n  x\n", "is on the next line"),
    ("KEY: x\n---\nKEY: y\n", "a second YAML document"), ("%YAML 1.1\n---\nKEY: x\n", "directives"),
    ('"KEY": x\n', "a quoted key"), ("  KEY: x\n", "an indented key"), ("? KEY\n: x\n", "complex key"),
    ('KEY: "a\n  b"\n', "the closing \" is missing"),
]


def load(fp8moe_bin, tmp_path, data: bytes):
    path = tmp_path / "c.yml"
    path.write_bytes(data)
    p = subprocess.run([fp8moe_bin, "train", str(path), f"base_output_directory={tmp_path}"],
                       capture_output=True, timeout=60, env=ENV)
    return p.returncode, p.stderr.decode("utf-8")


def oracle(data: bytes) -> str:
    """The string PyYAML reads for KEY: null as "" (what a string flag takes)."""
    if yaml.safe_load(data)[KEY] is None:
        return ""
    return yaml.load(data, Loader=yaml.BaseLoader)[KEY]  # no implicit typing: the text


@pytest.mark.parametrize("value", VALUES)
def test_values_read_as_pyyaml_reads_them(fp8moe_bin, tmp_path, value):
    data = f"{KEY}: {value}\n".encode()
    code, err = load(fp8moe_bin, tmp_path, data)
    assert code == 2, err
    m = ECHO.search(err)
    assert m, err
    assert m.group(1) == oracle(data), (value, err)


@pytest.mark.parametrize("data", FILES)
def test_file_forms_read_as_pyyaml_reads_them(fp8moe_bin, tmp_path, data):
    data = data.replace(b"KEY", KEY.encode())
    code, err = load(fp8moe_bin, tmp_path, data)
    m = ECHO.search(err)
    assert code == 2 and m, err
    assert m.group(1) == oracle(data), (data, err)


@pytest.mark.parametrize("text", MALFORMED)
def test_what_pyyaml_refuses_is_refused(fp8moe_bin, tmp_path, text):
    text = text.replace("KEY", KEY)
    with pytest.raises(yaml.YAMLError):
        yaml.safe_load(text)
    code, err = load(fp8moe_bin, tmp_path, text.encode())
    assert code == 2, err
    assert err.startswith("error: ") and re.search(r"c\.yml line \d+(, column \d+)?", err), err
    assert not ECHO.search(err), err


@pytest.mark.parametrize("text,part", UNSUPPORTED)
def test_yaml_outside_the_subset_is_refused_with_line_and_column(fp8moe_bin, tmp_path, text, part):
    text = text.replace("KEY", KEY)
    list(yaml.safe_load_all(text))  # valid YAML ...
    code, err = load(fp8moe_bin, tmp_path, text.encode())
    assert code == 2, err  # ... that config files do not take
    assert re.search(r"c\.yml line \d+, column \d+: ", err) and part in err, err


MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models")
PRESETS = sorted(f[:-4] for f in os.listdir(MODELS) if f.endswith(".yml"))


def print_config(fp8moe_bin, *args):
    return subprocess.run([fp8moe_bin, "train", *args, "--print-config"], capture_output=True,
                          text=True, timeout=60, env=ENV)


def test_there_are_presets():
    assert {"mixtral-small", "mixtral-8x7b", "qwen3-moe-small", "qwen3-30b-a3b", "deepseek3-small",
            "deepseek3-tiny", "deepseek3-671b"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_resolves_to_its_file_and_prints_a_config_for_the_same_run(fp8moe_bin, tmp_path,
                                                                             name):
    """--print-config shows every key of configs/models/NAME.yml (read by PyYAML) at the
    file's value; the printed config, given back as a file, prints itself again."""
    p = print_config(fp8moe_bin, f"model_name={name}")
    assert p.returncode == 0, p.stderr
    resolved = yaml.safe_load(p.stdout)
    with open(os.path.join(MODELS, name + ".yml")) as f:
        preset = yaml.safe_load(f)
    assert resolved["model_name"] == name
    for key, value in preset.items():
        # PyYAML (YAML 1.1) reads 1e-06, as we print it, as a string: compare numbers as numbers.
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        got = float(resolved[key]) if number else resolved[key]
        assert got == value, (key, resolved[key], value)
    path = tmp_path / "resolved.yml"
    path.write_text(p.stdout)
    again = print_config(fp8moe_bin, str(path))
    assert again.returncode == 0, again.stderr
    assert again.stdout == p.stdout


def test_a_preset_flag_changes_only_with_override_model_config(fp8moe_bin):
    p = print_config(fp8moe_bin, "model_name=mixtral-small", "base_num_kv_heads=4")
    assert p.returncode == 2
    assert ("model_name=mixtral-small sets base_num_kv_heads to 2 (configs/models/"
            "mixtral-small.yml), and the config file or the command line sets it to 4; pass "
            "override_model_config=true") in p.stderr, p.stderr
    p = print_config(fp8moe_bin, "model_name=mixtral-small", "base_num_kv_heads=4",
                     "override_model_config=true")
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["base_num_kv_heads"] == 4
    p = print_config(fp8moe_bin, "model_name=mixtral-smal")
    assert p.returncode == 2
    assert "did you mean model_name=mixtral-small?" in p.stderr, p.stderr


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek3-671b"])
def test_a_full_size_preset_is_refused_by_the_memory_plan(fp8moe_bin, tmp_path, name):
    p = subprocess.run([fp8moe_bin, "--memory-cap", "16G", "train", f"model_name={name}",
                        f"base_output_directory={tmp_path}"], capture_output=True, text=True,
                       timeout=60, env=ENV)
    assert p.returncode == 2, p.stderr
    assert "memory cap is 17179869184 bytes" in p.stderr, p.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["mixtral-small", "qwen3-moe-small", "deepseek3-small"])
def test_a_small_preset_trains(fp8moe_bin, tmp_path, name):
    """Each small preset trains (native FP8, the default mode) with finite losses; the
    DeepSeek one logs its first layer dense (no load, no bias) and moves its MoE layers'
    routing biases by the rate, 0.001 per step, from zero."""
    p = subprocess.run([fp8moe_bin, "train", f"model_name={name}", "steps=4", "log_period=1",
                        "eval_interval=4", "enable_checkpointing=false",
                        f"base_output_directory={tmp_path}", "run_name=r"],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr
    with open(tmp_path / "r" / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 4
    assert all(math.isfinite(m["loss"]) for m in lines)
    if name != "deepseek3-small":
        assert "router_bias" not in lines[-1]
        return
    bias = lines[-1]["router_bias"]
    assert bias[0] == [] and lines[-1]["expert_load"][0] == []
    for layer in bias[1:]:
        assert len(layer) == 16
        # four updates of +-0.001 or 0 each: a multiple of 0.001 in [-0.004, 0.004]
        assert all(abs(b) <= 0.004 + 1e-9 for b in layer)
        assert any(b != 0 for b in layer)
