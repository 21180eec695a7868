"""The layering rule (docs/design.md §1): a layer includes its own headers and
those of the layers below it, never one beside or above it.

Reads the `#include "..."` lines of every tracked C++ file and checks each
against the allowed graph stated once below. Needs no build.
"""
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The layers bottom-up; a tier's layers may include every layer of the tiers
# before it, and none of their own tier but themselves.
TIERS = [
    ["base"],
    ["numerics"],
    ["quant"],
    ["kernels", "io", "distributed"],
    ["moe"],
    ["model"],
    ["train"],
    ["bench"],            # the benchmarks: a library the command uses
    ["cli"],
]
# Beside the tiers: the Python extension binds the library (not the benches),
# and tests/consumer builds against the installed public headers only.
EXTRA = {
    "python": {"base", "numerics", "quant", "kernels", "io", "distributed", "moe", "model", "train"},
}
CONSUMER = "tests"  # may include "fp8moe/..." headers and nothing else

# Which layer each public header of include/fp8moe/ belongs to.
PUBLIC = {
    "status.h": "base", "dtype.h": "base", "tensor.h": "base", "memory.h": "base",
    "context.h": "base", "version.h": "base",
    "numerics.h": "numerics", "finite.h": "numerics",
    "quant.h": "quant",
    "gmm.h": "kernels",
    "safetensors.h": "io", "config.h": "io", "flag_table.h": "io",
    "communicator.h": "distributed", "dist.h": "distributed", "mpi.h": "distributed",
    "moe.h": "moe", "moe_config.h": "moe",
    "model.h": "model", "data.h": "model",
    "train.h": "train",
}

# Third-party headers included with quotes.
EXTERNAL = {"hwy", "gtest", "gmock", "xla", "nanobind"}

# Includes that break the rule today, each with its reason. An entry that no
# longer occurs fails the test too, so the list only shrinks.
KNOWN = {
    ("base/test_util.h", "fp8moe/numerics.h"):
        "the tests' SimdTargets() helper lists numerics' SIMD targets from base/",
    ("io/config_fuzz.cc", "fp8moe/gmm.h"):
        "the config fuzzer checks tile bounds against kMaxGmmTile",
    ("io/config_fuzz.cc", "fp8moe/moe_config.h"):
        "the config fuzzer runs the MoE schema and rules",
    ("io/config_fuzz.cc", "fp8moe/train.h"):
        "the config fuzzer runs the trainer's schema, rules and memory plan",
}


def allowed_graph():
    allowed = {}
    below = set()
    for tier in TIERS:
        for layer in tier:
            allowed[layer] = below | {layer}
        below = below | set(tier)
    for layer, deps in EXTRA.items():
        allowed[layer] = deps | {layer}
    return allowed


ALLOWED = allowed_graph()
INCLUDE = re.compile(r'^\s*#\s*(?:include\s+"([^"]+)"|define\s+HWY_TARGET_INCLUDE\s+"([^"]+)")')


def tracked_sources():
    """The tracked C++ files; outside a git checkout, every one under ROOT but build/."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "*.h", "*.cc", "*.cpp", "*.hpp"],
                             cwd=ROOT, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        return sorted(str(p.relative_to(ROOT)) for ext in ("h", "cc", "cpp", "hpp")
                      for p in ROOT.rglob("*." + ext)
                      if not p.relative_to(ROOT).parts[0].startswith(("build", ".")))


def owner_of_file(path):
    parts = path.split("/")
    if parts[0] == "include":
        return PUBLIC.get(parts[-1], "?public " + parts[-1])
    return parts[0]


def owner_of_include(name):
    parts = name.split("/")
    if parts[0] == "fp8moe":
        return PUBLIC.get(parts[-1], "?public " + parts[-1])
    return parts[0]


def includes(path):
    text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        m = INCLUDE.match(line)
        if m:
            yield number, m.group(1) or m.group(2)


def check(files):
    """(violations, known ones seen): every include that breaks the rule."""
    violations, seen = [], set()
    for path in files:
        layer = owner_of_file(path)
        for number, name in includes(path):
            target = owner_of_include(name)
            if target in EXTERNAL:
                continue
            where = f"{path}:{number}: #include \"{name}\""
            if layer.startswith("?") or target.startswith("?"):
                violations.append(f"{where}: {layer if layer.startswith('?') else target} "
                                  "has no layer; add it to PUBLIC in tests/python/test_layering.py")
            elif layer == CONSUMER:
                if not name.startswith("fp8moe/"):
                    violations.append(f"{where}: {CONSUMER}/ uses the installed public "
                                      "headers only (fp8moe/...)")
            elif layer not in ALLOWED:
                violations.append(f"{where}: folder '{layer}' is no layer; add it to TIERS "
                                  "in tests/python/test_layering.py and to docs/design.md §1")
            elif target not in ALLOWED and target != CONSUMER:
                violations.append(f"{where}: '{target}' is no layer")
            elif target not in ALLOWED[layer]:
                if (path, name) in KNOWN:
                    seen.add((path, name))
                else:
                    violations.append(f"{where}: {layer} may include only "
                                      f"{', '.join(sorted(ALLOWED[layer]))}, not {target} "
                                      "(docs/design.md §1)")
    return violations, seen


def test_every_include_follows_the_layering():
    violations, _ = check(tracked_sources())
    assert not violations, "includes against the layering rule:\n" + "\n".join(violations)


def test_known_exceptions_still_exist():
    _, seen = check(tracked_sources())
    gone = sorted(set(KNOWN) - seen)
    assert not gone, ("these known exceptions no longer occur; remove them from KNOWN in "
                      f"tests/python/test_layering.py: {gone}")


def test_the_rule_itself():
    # The graph as docs/design.md §1 and the README draw it.
    assert "numerics" not in ALLOWED["base"]
    assert ALLOWED["quant"] == {"base", "numerics", "quant"}
    for sibling in ("kernels", "io", "distributed"):
        assert ALLOWED[sibling] == {"base", "numerics", "quant", sibling}
    assert {"kernels", "io", "distributed"} < ALLOWED["moe"]
    assert "moe" in ALLOWED["model"] and "model" in ALLOWED["train"]
    assert "train" in ALLOWED["bench"] and "bench" in ALLOWED["cli"]
    assert "cli" not in ALLOWED["python"] and "bench" not in ALLOWED["python"]
    assert set(PUBLIC.values()) <= set(ALLOWED)
    on_disk = {p.name for p in (ROOT / "include/fp8moe").glob("*.h")}
    assert on_disk == set(PUBLIC), f"public headers without a layer: {sorted(on_disk - set(PUBLIC))}"
