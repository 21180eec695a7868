"""`fp8moe bench ... --json`: every bench carries the ceilings it measured in
its own run (register-only peaks, bandwidths, OpenBLAS sgemm from a core right
for this CPU), and its ratios are the numbers they claim to be.

These tests check structure and arithmetic consistency, never speed: timings
on a shared machine are noisy. The one comparison of two timings (sgemm cannot
beat the measured FMA peak by more than 20%) runs on one thread, where both
see the same share of a busy machine.
"""
import json
import math
import os
import pathlib
import subprocess

import pytest
import yaml  # tests/python/requirements.txt pins it

DECODE = dict(e=8, m=64, k=2048, n=4096)  # the `decode` shape of bench/bench_gmm.cc
PEAK_NAMES = {"f32_fma", "bf16_dot", "int16_pairs", "int16_vnni", "int8_vnni"}
GOOD_CORES = {"avx2": {"Haswell", "Zen"}, "avx512": {"SkylakeX", "Cooperlake", "SapphireRapids"}}


def cpu_flags():
    text = pathlib.Path("/proc/cpuinfo").read_text()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def run_bench(fp8moe_bin, *args, env_extra=None, simd=None):
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    env.update(env_extra or {})
    cmd = [fp8moe_bin] + (["--simd", simd] if simd else []) + ["bench", *args, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def decode_gmm(fp8moe_bin, *extra, **kw):
    return run_bench(fp8moe_bin, "gmm", "--shape", "decode", "--reps", "1", "--fwd-only",
                     *extra, **kw)


# The fastest bench with an sgemm ceiling (one f32 MoE step of 64 tokens).
SMALL_MOE = ("moe", "--tokens", "64", "--shape", "f32", "--reps", "1", "--threads", "1")


def check_ceilings(c, threads):
    assert c["threads"] == threads
    assert set(c["peaks"]) == PEAK_NAMES
    f32 = c["peaks"]["f32_fma"]
    assert f32["available"] and f32["kernels_use"] and f32["gops"] > 0
    assert f32["lanes"] >= 1 and f32["chains"] >= 8
    assert f32["ops_per_instruction"] == 2 * f32["lanes"]
    for name, p in c["peaks"].items():
        assert (p["gops"] > 0) == p["available"], name
        assert p["what"] and "registers" in p["what"], name
    assert c["peaks"]["int16_pairs"]["available"]  # every target has vpmaddwd or its emulation
    assert c["read_gbs"] > 0 and c["memcpy_gbs"] > 0
    # Measured before and after the timed work, the higher of each kept; the
    # moves over 10% are named.
    assert c["measurements"] == 2
    assert all(isinstance(m, str) and " then " in m for m in c["moved"]), c["moved"]
    if "sse2" in cpu_flags():  # x86: the clock comes from rdtsc and an add chain
        assert c["core_ghz"] > 0 and c["tsc_ghz"] > 0
        assert f32["ops_per_cycle"] > 0
        for name, p in c["peaks"].items():  # over the clock kept with them
            assert p["ops_per_cycle"] == pytest.approx(
                p["gops"] / (c["core_ghz"] * threads) if p["available"] else 0, rel=1e-9), name
        assert c["f32_fma_two_pipe_estimate_gflops"] == pytest.approx(
            2 * f32["ops_per_instruction"] * c["core_ghz"] * threads, rel=1e-9)


def test_gmm_json_has_ceilings_and_consistent_ratios(fp8moe_bin):
    j, _ = decode_gmm(fp8moe_bin, "--threads", "1")
    c = j["ceilings"]
    check_ceilings(c, 1)
    assert j["read_gbs"] == c["read_gbs"] and j["memcpy_gbs"] == c["memcpy_gbs"]
    assert c["simd_target"] == j["simd_target"]

    s = j["sgemm"]
    assert s["loaded_core"] and s["core"] and s["loaded_config"].startswith("OpenBLAS")
    assert s["trusted"], s  # this CPU's own core, or a child with a right one
    if s["cpu_isa"] in GOOD_CORES:
        assert s["core"] in GOOD_CORES[s["cpu_isa"]]
    [shape] = s["shapes"]
    assert (shape["m"], shape["k"], shape["n"]) == (DECODE["m"], DECODE["k"], DECODE["n"])
    flops = 2.0 * DECODE["m"] * DECODE["k"] * DECODE["n"]
    assert shape["gflops"] == pytest.approx(flops / shape["seconds"] / 1e9, rel=1e-9)

    peaks = c["peaks"]
    fma = peaks["f32_fma"]["gops"]
    # A sgemm above the measured FMA peak means one of the two is wrong.
    assert shape["gflops"] <= 1.2 * fma, (shape["gflops"], fma)

    rows = j["rows"]
    # The sgemm timed again in the pass's rounds (a child with the ceiling's
    # core) is the 'x sgemm' of that pass's rows.
    assert j["sgemm_in_rounds"] and j["sgemm_not_in_rounds_because"] == ""
    [sg] = [r for r in rows if r["mode"] == "openblas"]
    assert sg["pass"] == "fwd" and sg["ratio_to_sgemm"] == pytest.approx(1.0, rel=1e-9), sg
    assert sg["gflops"] <= 1.2 * fma, (sg["gflops"], fma)
    # The streaming read timed among the decode shape's modes: its faster
    # run is the read ceiling of that shape's rows.
    reads = [r for r in rows if r["pass"] == "read"]
    assert {r["mode"] for r in reads} == {"stream", "stream+pf"}
    ceiling = max(r["gbs"] for r in reads)
    for r in reads:
        assert r["gflops"] is None and r["bound_peak"] is None and r["ratio_to_sgemm"] is None
        assert r["ratio_to_read"] == pytest.approx(r["gbs"] / ceiling, rel=1e-9)
    rows = [r for r in rows if r["pass"] != "read"]
    for r in rows:
        if r["mode"] != "openblas":
            assert r["gbs"] > 0 and r["read_ceiling_gbs"] == ceiling, r
            assert r["ratio_to_read"] == pytest.approx(r["gbs"] / ceiling, rel=1e-9), r
    modes = {r["mode"] for r in rows}
    assert {"openblas", "f32", "bf16", "fake_qat", "native_fp8", "int8"} <= modes
    for r in rows:
        assert r["gflops"] == pytest.approx(flops / r["seconds"] / 1e9, rel=1e-9), r
        assert r["ratio_to_sgemm"] == pytest.approx(r["gflops"] / sg["gflops"], rel=1e-9), r
        assert r["bound_peak"] in PEAK_NAMES and peaks[r["bound_peak"]]["available"], r
        assert r["ratio_to_peak"] == pytest.approx(
            r["gflops"] / peaks[r["bound_peak"]]["gops"], rel=1e-9), r
        assert r["ratio_to_fma_peak"] == pytest.approx(r["gflops"] / fma, rel=1e-9), r
        # The bound is the instruction the kernels use for the row's arithmetic.
        if r["mode"] in ("f32", "openblas"):
            assert r["bound_peak"] == "f32_fma", r
        elif r["mode"] == "int8":
            assert r["bound_peak"] in ("int16_pairs", "int16_vnni"), r
            assert peaks[r["bound_peak"]]["kernels_use"], r
        else:
            want = "bf16_dot" if peaks["bf16_dot"]["kernels_use"] else "f32_fma"
            assert r["bound_peak"] == want, r


def check_interval(iv, a, b):
    """A PairedRatioInterval in JSON against the round times it came from:
    the median and the order statistics of the sign test (bench/bench_util.h;
    its table is checked in bench_util_test.cc)."""
    ratios = sorted(x / y for x, y in zip(a, b))
    n = len(ratios)
    assert iv["rounds"] == n
    mid = ratios[n // 2] if n % 2 else 0.5 * (ratios[n // 2 - 1] + ratios[n // 2])
    assert iv["median"] == pytest.approx(mid, rel=1e-9)
    cdf = lambda j: sum(math.comb(n, i) for i in range(j + 1)) / 2 ** n
    k = 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * cdf(k) >= 0.95:
        k += 1
    assert iv["low"] == pytest.approx(ratios[k - 1], rel=1e-9)
    assert iv["high"] == pytest.approx(ratios[n - k], rel=1e-9)
    assert iv["coverage"] == pytest.approx(1 - 2 * cdf(k - 1), abs=1e-12)
    want = "faster" if iv["high"] < 1 else "slower" if iv["low"] > 1 else "parity"
    assert iv["verdict"] == want


def test_gmm_native_time_ratios_are_of_its_rows(fp8moe_bin):
    """The issue's native targets (fwd against bf16, dlhs against fake_qat),
    from modes timed interleaved, are the ratios of the rows' own times."""
    j, err = run_bench(fp8moe_bin, "gmm", "--shape", "fine-grained", "--reps", "1",
                       "--threads", "1")
    secs = {(r["pass"], r["mode"]): r["seconds"] for r in j["rows"]}
    [t] = j["native_time_ratios"]
    assert t["shape"] == "fine-grained"
    assert t["native_fwd_over_bf16_fwd"] == pytest.approx(
        secs[("fwd", "native_fp8")] / secs[("fwd", "bf16")], rel=1e-9)
    assert t["native_dlhs_over_fake_qat_dlhs"] == pytest.approx(
        secs[("dlhs", "native")] / secs[("dlhs", "fake_qat")], rel=1e-9)
    # Each row's best is the least of its rounds; the intervals are of the
    # rounds' own ratios.
    rounds = {(r["pass"], r["mode"]): r["seconds_per_round"] for r in j["rows"]}
    for key, r in rounds.items():
        assert len(r) == 1 and secs[key] == pytest.approx(min(r), rel=1e-12), key
    for field, a, b in (("native_fwd_over_bf16_fwd_interval", ("fwd", "native_fp8"), ("fwd", "bf16")),
                        ("native_dlhs_over_fake_qat_dlhs_interval", ("dlhs", "native"),
                         ("dlhs", "fake_qat"))):
        check_interval(t[field], rounds[a], rounds[b])
    # Every pass's modes ran (the interleaved queue lost none); a compute-bound
    # shape has no read rows and no read ceiling.
    # The shape's sgemm ran in every pass's rounds.
    assert {m for p, m in secs if p == "tgmm"} == {"openblas", "f32", "bf16", "fp8_full",
                                                  "fp8_inkern"}
    assert "read" not in {p for p, m in secs}
    assert all(r["read_ceiling_gbs"] is None for r in j["rows"])
    assert {m for p, m in secs if p == "dlhs"} == {"openblas", "f32", "bf16", "native", "fake_qat"}
    assert ("fwd", "openblas") in secs


def test_peaks_follow_the_simd_target(fp8moe_bin):
    quant = ("quant", "--elements", "8192", "--reps", "1", "--threads", "1")
    j, _ = run_bench(fp8moe_bin, *quant, simd="SSE4")
    assert j["simd_target"] == "SSE4" and j["ceilings"]["simd_target"] == "SSE4"
    peaks = j["ceilings"]["peaks"]
    assert peaks["f32_fma"]["lanes"] == 4 and "no FMA" in peaks["f32_fma"]["instruction"]
    assert peaks["int16_pairs"]["lanes"] == 4
    for name in ("bf16_dot", "int16_vnni", "int8_vnni"):  # no such SSE4 instructions
        assert not peaks[name]["available"], name
    if "avx2" in cpu_flags():
        j2, _ = run_bench(fp8moe_bin, *quant, simd="AVX2")
        assert j2["ceilings"]["simd_target"] == "AVX2"
        assert j2["ceilings"]["peaks"]["f32_fma"]["lanes"] == 8
        assert "vfmadd" in j2["ceilings"]["peaks"]["f32_fma"]["instruction"]


def test_fallback_core_is_replaced_in_a_child(fp8moe_bin):
    """The issue's Xeon loaded OpenBLAS's generic Prescott kernels; forcing the
    same here must make the bench measure sgemm in a child with a right core."""
    if "avx2" not in cpu_flags():
        pytest.skip("Prescott is the right core on a CPU without AVX2")
    j, _ = run_bench(fp8moe_bin, *SMALL_MOE, env_extra={"OPENBLAS_CORETYPE": "Prescott"})
    s = j["sgemm"]
    assert s["loaded_core"] == "Prescott" and s["loaded_fallback"], s
    assert s["trusted"] and s["coretype_env"] and s["core"] != "Prescott", s
    assert s["core"] in GOOD_CORES[s["cpu_isa"]], s
    assert any("right for this CPU" in a for a in s["attempts"]), s
    # Timed again in the rounds, by a child with that core (it says its core
    # and another one is refused), so the ceiling is the best of those.
    assert j["sgemm_in_rounds"] and j["sgemm_not_in_rounds_because"] == "", j
    assert 0 < j["sgemm_gflops"] <= 1.2 * j["ceilings"]["peaks"]["f32_fma"]["gops"]


def test_gmm_times_sgemm_in_rounds_with_the_ceilings_core(fp8moe_bin):
    """With a fallback loaded here, the sgemm of the pass's rounds runs in a
    child with the right core (the child's core is checked against the
    ceiling's); with no right core the sgemm timed before the rows is shown
    for reference and no row claims a ratio to it."""
    if "avx2" not in cpu_flags():
        pytest.skip("Prescott is the right core on a CPU without AVX2")
    j, _ = decode_gmm(fp8moe_bin, "--threads", "1", env_extra={"OPENBLAS_CORETYPE": "Prescott"})
    assert j["sgemm"]["trusted"] and j["sgemm"]["coretype_env"] and j["sgemm_in_rounds"], j["sgemm"]
    [sg] = [r for r in j["rows"] if r["mode"] == "openblas"]
    assert sg["pass"] == "fwd"
    for r in j["rows"]:
        if r["pass"] == "fwd":
            assert r["ratio_to_sgemm"] == pytest.approx(r["gflops"] / sg["gflops"], rel=1e-9), r

    j, err = decode_gmm(fp8moe_bin, "--threads", "1", "--sgemm-core", "Prescott")
    assert not j["sgemm"]["trusted"] and not j["sgemm_in_rounds"]
    assert "no OpenBLAS core right for this CPU" in j["sgemm_not_in_rounds_because"]
    [sg] = [r for r in j["rows"] if r["mode"] == "openblas"]
    assert sg["pass"] == "sgemm" and sg["seconds"] == j["sgemm"]["shapes"][0]["seconds"], sg
    assert all(r["ratio_to_sgemm"] is None for r in j["rows"])
    assert "WARNING" in err


def test_sgemm_serve_answers_each_request_and_refuses_bad_ones(fp8moe_bin):
    """`bench sgemm --serve`, the child that times sgemm among a bench's rounds:
    it names its core, answers each shape index with a time, ends at end of
    input, and refuses an index it does not have."""
    cmd = [fp8moe_bin, "bench", "sgemm", "--serve", "--sizes", "64x128x256,32x32x32",
           "--threads", "1"]
    p = subprocess.run(cmd, input="0\n1\n1\n", capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 4 and lines[0].startswith("core ") and len(lines[0]) > 5, lines
    assert all(float(t) > 0 for t in lines[1:]), lines
    for bad in ("2\n", "x\n", "0x\n"):
        p = subprocess.run(cmd, input=bad, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "not a shape index below 2" in p.stderr, (bad, p.stderr)
    p = subprocess.run([fp8moe_bin, "bench", "gmm", "--serve"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "--serve is an option of bench sgemm only" in p.stderr, p.stderr


def test_no_right_core_is_loud_and_uses_the_fma_peak(fp8moe_bin):
    if "avx2" not in cpu_flags():
        pytest.skip("Prescott is the right core on a CPU without AVX2")
    j, err = run_bench(fp8moe_bin, *SMALL_MOE, "--sgemm-core", "Prescott")
    s = j["sgemm"]
    assert not s["trusted"] and s["core"] == "Prescott", s
    assert "WARNING" in err and "NOT a ceiling" in err
    assert j["sgemm_gflops"] is None and not j["sgemm_in_rounds"]
    assert "no OpenBLAS core right for this CPU" in j["sgemm_not_in_rounds_because"]
    for r in j["rows"]:
        assert r["ratio_to_sgemm"] is None, r
    # The text table says so where the ratios are.
    p = subprocess.run([fp8moe_bin, "bench", *SMALL_MOE, "--sgemm-core", "Prescott"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "x FMA peak!" in p.stdout and "NO TRUSTED SGEMM CEILING" in p.stdout


def test_sgemm_core_that_cannot_run_here_is_caught(fp8moe_bin):
    flags = cpu_flags()
    if "avx512f" in flags or "avx2" not in flags:
        pytest.skip("needs an AVX2 CPU without AVX-512")
    j, err = run_bench(fp8moe_bin, *SMALL_MOE, "--sgemm-core", "SkylakeX")
    s = j["sgemm"]
    assert not s["trusted"] and any("SIGILL" in a for a in s["attempts"]), s
    assert "WARNING" in err


def test_quant_and_moe_carry_ceilings(fp8moe_bin):
    j, _ = run_bench(fp8moe_bin, "quant", "--elements", "65536", "--reps", "1", "--threads", "1")
    check_ceilings(j["ceilings"], 1)
    assert j["memcpy_gbs"] == j["ceilings"]["memcpy_gbs"]
    for r in j["rows"]:
        assert r["ratio_to_memcpy"] == pytest.approx(r["gbs"] / j["memcpy_gbs"], rel=1e-9)

    j, _ = run_bench(fp8moe_bin, *SMALL_MOE)
    check_ceilings(j["ceilings"], 1)
    assert j["sgemm"]["trusted"]
    [row] = j["rows"]
    assert row["bound_peak"] == "f32_fma"
    assert row["ratio_to_sgemm"] == pytest.approx(row["gflops"] / j["sgemm_gflops"], rel=1e-9)
    assert row["ratio_to_peak"] == pytest.approx(
        row["gflops"] / j["ceilings"]["peaks"]["f32_fma"]["gops"], rel=1e-9)


def test_moe_interleaves_rounds_and_ratios_native_to_fake(fp8moe_bin):
    """Every mode runs once per round (the trainer's steady-state step), and
    the native / fake_qat ratios are the numbers they claim to be."""
    # --shape "a" picks fake_qat, native fwd, native fwd+dlhs, fp8 (hand-crafted), nanoo_fp8.
    j, err = run_bench(fp8moe_bin, "moe", "--tokens", "64", "--shape", "a", "--reps", "3",
                       "--threads", "1")
    rows = {r["mode"]: r for r in j["rows"]}
    assert set(rows) == {"fake_qat", "native fwd", "native fwd+dlhs", "fp8 (hand-crafted)",
                         "nanoo_fp8"}, rows
    fake = rows["fake_qat"]
    for r in rows.values():
        assert len(r["step_seconds_per_round"]) == 3, r
        # Best forward and best backward may come from different rounds.
        assert r["fwd_seconds"] + r["bwd_seconds"] <= min(r["step_seconds_per_round"]) * (1 + 1e-9)
        assert r["peak_bytes"] > 0, r
    for name in ("native fwd", "native fwd+dlhs"):
        r = rows[name]
        best = (r["fwd_seconds"] + r["bwd_seconds"]) / (fake["fwd_seconds"] + fake["bwd_seconds"])
        assert r["step_ratio_to_fake_qat"] == pytest.approx(best, rel=1e-9)
        per_round = sorted(a / b for a, b in zip(r["step_seconds_per_round"],
                                                 fake["step_seconds_per_round"]))
        assert r["step_ratio_to_fake_qat_median_round"] == pytest.approx(per_round[1], rel=1e-9)
        check_interval(r["step_ratio_to_fake_qat_interval"], r["step_seconds_per_round"],
                       fake["step_seconds_per_round"])
        check_interval(r["fwd_ratio_to_fake_qat_interval"], r["fwd_seconds_per_round"],
                       fake["fwd_seconds_per_round"])
        check_interval(r["bwd_ratio_to_fake_qat_interval"], r["bwd_seconds_per_round"],
                       fake["bwd_seconds_per_round"])
    for name in ("fp8 (hand-crafted)", "nanoo_fp8", "fake_qat"):
        assert "step_ratio_to_fake_qat" not in rows[name]
    # The table's note says the same interval in words.
    p = subprocess.run([fp8moe_bin, "bench", "moe", "--tokens", "64", "--shape", "at",
                        "--reps", "6", "--threads", "1"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    for name in ("native fwd", "native fwd+dlhs"):
        [line] = [l for l in p.stdout.splitlines() if l.startswith(name + " / fake_qat step time")]
        # Six rounds: the sign test's interval is [min, max], coverage 96.875%.
        assert "median of 6 rounds' ratios, 96.8% interval" in line, line
        assert line.split("interval ")[1].split(":")[1].split()[0] in ("faster", "slower",
                                                                       "parity"), line
    # A list picks modes by their exact names ("native fwd" is not taken with
    # "native fwd+dlhs"); a name that is no mode is refused with the modes.
    j, _ = run_bench(fp8moe_bin, "moe", "--tokens", "64", "--shape", "fake_qat,native fwd+dlhs",
                     "--reps", "1", "--threads", "1")
    assert [r["mode"] for r in j["rows"]] == ["fake_qat", "native fwd+dlhs"], j["rows"]
    p = subprocess.run([fp8moe_bin, "bench", "moe", "--tokens", "64", "--shape",
                        "fake_qat,native", "--reps", "1"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 2, p.stderr
    assert "'native' is no mode of bench moe" in p.stderr and "'native fwd+dlhs'" in p.stderr
    # Without fake_qat in the run there is no ratio (it printed "inf" before).
    p = subprocess.run([fp8moe_bin, "bench", "moe", "--tokens", "64", "--shape", "native",
                        "--reps", "1", "--threads", "1"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    assert "inf" not in p.stdout and "fake_qat step time" not in p.stdout, p.stdout
    assert "native fwd+dlhs" in p.stdout


def test_moe_refuses_what_does_not_fit_with_a_message(fp8moe_bin):
    """A refused allocation aborted bench moe (a .value() on the cap's
    refusal); modes that together outgrow the cap are refused up front."""
    env = dict(os.environ, FP8MOE_MEMORY_CAP="1G")
    p = subprocess.run([fp8moe_bin, "bench", "moe", "--tokens", "1048576", "--reps", "1",
                        "--threads", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "resource exhausted" in p.stderr and "FP8MOE_MEMORY_CAP" in p.stderr, p.stderr
    env["FP8MOE_MEMORY_CAP"] = "2G"
    p = subprocess.run([fp8moe_bin, "bench", "moe", "--tokens", "4096", "--reps", "1",
                        "--threads", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "keeps every mode's buffers" in p.stderr and "--shape" in p.stderr, p.stderr


def test_bench_sgemm_and_bad_sizes(fp8moe_bin):
    j, _ = run_bench(fp8moe_bin, "sgemm", "--sizes", "64x128x256,32x32x32", "--reps", "1",
                     "--threads", "1")
    assert j["openblas_core"] and [(r["m"], r["k"], r["n"]) for r in j["rows"]] == [
        (64, 128, 256), (32, 32, 32)]
    for bad in ("5x5", "0x1x1", "1x1x1x1", "axbxc", "", "2x2x2000000"):
        p = subprocess.run([fp8moe_bin, "bench", "sgemm", "--sizes", bad], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and "--sizes" in p.stderr, (bad, p.stderr)
    p = subprocess.run([fp8moe_bin, "bench", "moe", "--sgemm-core", "Bogus"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "--sgemm-core" in p.stderr and "Haswell" in p.stderr, p.stderr


def test_shape_that_matches_nothing_is_an_error(fp8moe_bin):
    """A --shape that picks nothing used to print an empty table and exit 0."""
    for args, names in ((["gmm", "--reps", "1"], "'decode e64'"),
                        (["moe", "--reps", "1", "--tokens", "8"], "'native fwd+dlhs'")):
        p = subprocess.run([fp8moe_bin, "bench", *args, "--shape", "nosuch"], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and "'nosuch' matches no" in p.stderr and names in p.stderr, p.stderr


TINY_BENCH_TRAIN = ["steps=2", "base_emb_dim=16", "base_num_decoder_layers=1",
                    "base_moe_mlp_dim=16", "max_target_length=16", "per_device_batch_size=4",
                    "eval_steps=1", "eval_interval=1"]


def test_bench_train_runs_the_model_name_preset(fp8moe_bin, tmp_path):
    """bench train model_name=NAME trains the preset in every mode (it used to read
    the keys without the preset, so every model_name trained the default model)."""
    p = subprocess.run([fp8moe_bin, "bench", "train", "model_name=mixtral-small", "steps=2",
                        "eval_steps=1", "eval_interval=1", "per_device_batch_size=2",
                        f"base_output_directory={tmp_path}"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    runs = sorted(d for d in tmp_path.iterdir() if d.is_dir())
    assert len(runs) == 6, runs
    for run in runs:
        config = yaml.safe_load(json.loads((run / "summary.json").read_text())["config"])
        assert config["model_name"] == "mixtral-small"
        assert config["base_num_kv_heads"] == 2 and config["num_experts"] == 8, run


def test_bench_train_never_deletes_a_directory_it_did_not_make(fp8moe_bin, tmp_path):
    """bench train empties <base>/<mode> before each run. It used to take a
    user's run_name= (all six modes then ran in, and deleted, that one directory,
    checkpoints and all) and to delete any directory of a mode's name."""
    base = tmp_path / "runs"
    keep = base / "mine" / "checkpoints"
    keep.mkdir(parents=True)
    (keep / "step_5.safetensors").write_bytes(b"x")

    def bench(*extra):
        return subprocess.run([fp8moe_bin, "bench", "train", *TINY_BENCH_TRAIN,
                               f"base_output_directory={base}", *extra],
                              capture_output=True, text=True, timeout=300)

    for key in ("run_name=mine", "quantization=int8", "fp8_moe_native_fwd=false"):
        p = bench(key)
        assert p.returncode == 2 and "sets '" + key.split("=")[0] + "' itself" in p.stderr, p.stderr
    # A directory of a mode's name that the bench did not make: refused
    # before any training, left as it was.
    (base / "fake_QAT").mkdir()
    (base / "fake_QAT" / "notes.txt").write_text("mine")
    p = bench()
    assert p.returncode == 2 and "was not made by bench train" in p.stderr, p.stderr
    assert "steps ..." not in p.stderr and not (base / "none_bf16").exists()
    assert (base / "fake_QAT" / "notes.txt").read_text() == "mine"
    (base / "fake_QAT" / "notes.txt").unlink()
    (base / "fake_QAT").rmdir()
    # Its own directories it empties and reuses.
    for _ in range(2):
        p = bench()
        assert p.returncode == 0, p.stderr
        assert (base / "none_bf16" / ".fp8moe_bench_train").exists()
        assert len((base / "int8" / "metrics.jsonl").read_text().splitlines()) == 2
    assert (keep / "step_5.safetensors").read_bytes() == b"x"


def test_bench_comm_empty_payload_range_is_an_error(fp8moe_bin):
    """--min-payload above --max-payload printed an empty table and exited 0."""
    p = subprocess.run([fp8moe_bin, "bench", "comm", "--min-payload", "262144", "--max-payload",
                        "65536"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--min-payload 262144 is above --max-payload 65536" in p.stderr, \
        p.stderr
