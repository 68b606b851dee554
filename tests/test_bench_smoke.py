"""Every benchmark runs at tiny sizes and ends with the JSON keys docs/benchmarks.md quotes.

Figures are not asserted here (a benchmark measures; it is not a test), except the exact
token count of the burst benchmark, which is a property of the scheduler, not of the machine.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

CASES = {
    "prefix_index.py": (
        ["--repeats", "2", "--trace-prompts", "50"],
        {"match_insert_us_20k", "ops_per_s"},
    ),
    "prefill.py": (
        ["--prefix", "64", "--suffix", "16"],
        {"cold_s", "warm_s", "speedup", "ideal_speedup", "efficiency"},
    ),
    "burst.py": (
        ["--n", "6", "--prefix", "100", "--suffix", "8", "--max-tokens", "2"],
        {
            "prompt_tokens_computed",
            "ideal_tokens",
            "peak_blocks",
            "ideal_blocks",
            "speedup_vs_nocache",
        },
    ),
    "hit_rate.py": (
        ["--prompts", "4", "--prefix", "64", "--requests", "40", "--pools", "8,64"],
        {"ideal_hit_rate", "rows", "working_set_blocks"},
    ),
    "ttft.py": (["--scale", "0.004"], {"cold_s", "warm_s", "speedup", "ideal_speedup"}),
    "shared_decode.py": (
        ["--batch", "4", "--prefix", "128", "--suffix", "8", "--repeat", "1"],
        set(),
    ),
    "cache_files.py": (
        ["--prefix", "64", "--suffix", "8"],
        {"load_s", "cold_first_token_s", "loaded_first_token_s", "speedup", "cached_tokens"},
    ),
    "routing.py": (
        ["--tenants", "2", "--conversations", "1", "--turns", "2", "--system-words", "40"],
        {"round_robin", "approximate", "precise", "ideal_hit_rate"},
    ),
    "upstream_routing.py": (
        ["--replicas", "2", "--prompts", "2", "--questions", "2", "--hop-requests", "2"],
        {"ours_computed_tokens", "round_robin_computed_tokens", "efficiency_vs_ideal"},
    ),
    "tokenization.py": (
        ["--prefix-tokens", "300", "--requests", "3"],
        {"whole_ms", "cached_ms", "speedup", "ideal_speedup"},
    ),
    "tiers.py": (
        ["--quick"],
        {"sweep", "hit_rate_vs_unbounded", "spill_policy", "long_prefix", "no_hits", "reload"},
    ),
    "soak.py": (
        ["--minutes", "0.4", "--rss-bound-mib", "400"],
        {"ok", "checks", "capacity_rps", "offered_rps", "rss_growth_mib", "statuses"},
    ),
    "serving.py": (
        ["--serve", "demo", "--groups", "2", "--per-group", "2", "--system", "40"]
        + ["--question", "8", "--output", "3", "--concurrency", "2", "--vocab", "2000"]
        + ["--warmup", "1", "--warmup-tokens", "16"],
        {"output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_mean_ms", "hit_rate", "errors"},
    ),
    "cpu_attention.py": (
        ["--prefill", "300", "--decodes", "3", "--max-len", "50", "--repeat", "1"],
        {"available", "cpu"},
    ),
    "cpu_layer_ops.py": (
        ["--model", "demo", "--decode-rows", "4", "--prefill-rows", "64", "--repeat", "1"]
        + ["--seqs", "2", "--prompt", "40", "--max-tokens", "30", "--rounds", "1", "--steps", "2"],
        {"available", "cpu"},
    ),
    "window_decode.py": (["--batch", "1"], {"cpu", "threads", "rows"}),
    "prompt_logprobs.py": (
        ["--model", "demo", "--lengths", "40", "--runs", "1"],
        {"cpu", "model", "dtype", "rows"},
    ),
    "layer_gemms.py": (
        ["--model", "demo", "--rows", "1", "4", "--full-rows", "32", "--seconds", "0.05"],
        {"cpu", "threads", "full", "rows", "blocks_vs_panels"},
    ),
    "kernel_ab.py": (  # the working tree's kernel against HEAD's (the demo model's panels)
        ["--model", "demo", "--layers", "1", "--head", "1", "--decode", "1", "--reps", "2"]
        + ["--context", "16"],
        {"cpu", "threads", "against", "layers", "head", "decode"},
    ),
    "row_attention.py": (["--scale", "0.05", "--reps", "1"], {"cpu", "target", "threads", "rows"}),
    "qgemm.py": (  # SmolLM2 (the named model, fetched once), tiny sizes
        ["--shapes", "64x256", "--rows", "1,8", "--repeat", "1", "--budget-ms", "1"]
        + ["--prompt", "16", "--decode-tokens", "4", "--rounds", "1"],
        {"cpu", "threads", "available"},
    ),
    "hybrid.py": (  # a tiny Gemma 3 made here (tiny_gemma3), tiny sizes
        ["--prefix", "64", "--requests", "3", "--context", "600", "--budget-mib", "48"]
        + ["--capacity-prefix", "600", "--max-length", "600", "--tier-requests", "2"],
        {"cpu", "shared", "lengths", "held", "capacity", "tier"},
    ),
    "gguf_to_hf.py": (["--check"], {"arch", "max_logit_diff_vs_transformers_gguf"}),
    "lm_head.py": (  # a tiny Q8_0 GGUF made here (tiny_q8_gguf), tiny sizes
        ["--rows", "1", "9", "--batches", "2", "--new-tokens", "2", "--seconds", "0.05"]
        + ["--accuracy-rows", "8"],
        {"cpu", "kernels", "rows", "accuracy", "decode"},
    ),
    "grammar.py": (
        ["--schemas", "12", "--batch", "8", "--steps", "4"],
        {"compile_total_s", "mask_median_ms", "refused"},
    ),
    "rag_reuse.py": (
        ["--model", "demo", "--passages", "6", "--questions", "2", "--max-tokens", "4"],
        {"ttft_speedup", "accuracy_delta", "agreement", "first_token_kl", "settings"},
    ),
    "kv_dtype.py": (
        ["--model", "demo", "--dtype", "float32", "--prompts", "2", "--max-tokens", "3"]
        + ["--zipf-prompts", "6", "--zipf-prefix", "64", "--zipf-requests", "40"]
        + ["--decode-context", "32", "--decode-tokens", "4"],
        {"tokens_per_gib_ratio", "recompute_ratio", "agreement", "first_token_kl", "decode_itl_ms"},
    ),
    "floor.py": (
        ["--seqs", "2", "--context", "32", "--prefill", "64", "--chunk", "32", "--repeat", "1"]
        + ["--gib", "0.05", "--gemm", "128"],
        {"dram_gb_per_s", "gemm_gflop_per_s", "decode_over_floor", "prefill_over_floor"},
    ),
    "sampler.py": (["--vocab", "4096", "--rounds", "3"], {"cpu", "rows"}),
    "step_overhead.py": (
        ["--model", "demo", "--tokens", "4", "--rounds", "1", "--gib", "0.02"],
        {
            "cpu",
            "real_step_ms",
            "fixed_step_ms",
            "fixed_share",
            "real_over_floor",
            "replayed_over_eager",
        },
    ),
    "step_replay.py": (
        ["--model", "demo", "--tokens", "1,4", "--context", "32", "--repeat", "2"],
        {"cpu", "rows", "context"},
    ),
    "startup.py": (  # the demo server timed against itself as the peer
        ["--model", "demo", "--runs", "1", "--peer-model", "demo", "--peer"]
        + [
            f"{shlex.quote(sys.executable)} -m prefixcache.sidecar.cli serve --model demo --port {{port}}"
        ],
        {"ours", "peer", "ready_vs_peer", "first_token_vs_peer"},
    ),
    "sidecar_overhead.py": (
        ["--requests", "3", "--warmup", "1", "--streams", "4", "--stream-tokens", "2"],
        {"http_added_outside_engine_p50_ms", "http_added_p50_ms", "stream_errors"},
    ),
}


def tiny_gemma3(folder: Path) -> Path:
    """A small Gemma 3 checkpoint with the real one's 5:1 local:global pattern (the bench's
    code paths, without loading the 262K-vocabulary file that its figures use)."""
    pytest.importorskip("transformers")
    from test_gemma3 import make_tiny_hf, save_tiny

    local, full = "sliding_attention", "full_attention"
    hf = make_tiny_hf(
        num_hidden_layers=6,
        layer_types=[local] * 5 + [full],
        sliding_window=64,
        max_position_embeddings=2048,
    )
    return save_tiny(hf, folder / "tiny-gemma3")


def tiny_q8_gguf(folder: Path) -> Path:
    """A small Llama GGUF, every weight Q8_0, its head tied (the integer head's form)."""
    test_gguf = pytest.importorskip("test_gguf")
    model = test_gguf.random_checkpoint(folder, len(test_gguf.demo_vocab()[0]), tied=True)
    path = folder / "tiny-q8.gguf"
    test_gguf.write_gguf(path, model, test_gguf.Q.Q8_0)
    return path


def run_bench(name: str, args: list[str]) -> dict:
    """Progress bars forced on (stderr is a pipe here): they must stay off stdout."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=900,  # a hang bound (soak and hybrid take minutes under load)
        check=False,
        env={**os.environ, "PREFIXCACHE_PROGRESS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result.get("available") is False:  # a kernel bench on a CPU without those kernels
        assert set(result) <= {"available", "cpu", "threads"}, result  # it measured nothing
        pytest.skip(f"{name}: its kernels do not run on this CPU ({result.get('cpu')})")
    assert "100%|" in proc.stderr, proc.stderr[-2000:]  # its main loop's bar ran to the end
    assert "100%|" not in proc.stdout
    return result


@pytest.mark.slow
@pytest.mark.timeout(960)  # past run_bench's own 900 s bound (the suite's default is 300 s)
@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs_and_reports(name: str, tmp_path: Path) -> None:
    args, keys = CASES[name]
    if name == "hybrid.py":
        args = [*args, "--model", str(tiny_gemma3(tmp_path))]
    if name == "lm_head.py":
        args = [*args, "--model", str(tiny_q8_gguf(tmp_path))]
    if name == "gguf_to_hf.py":  # the tiny Llama GGUF into a folder (q/k rows unpermuted)
        args = [str(tiny_q8_gguf(tmp_path)), str(tmp_path / "hf"), *args]
    result = run_bench(name, args)
    assert keys <= result.keys(), keys - result.keys()
    if name == "serving.py":  # every request streamed all its tokens; the groups shared
        assert result["errors"] == 0 and result["output_tokens"] == 4 * 3
        assert result["hit_rate"] > 0
    if name == "cache_files.py":  # the loaded prefix is hit and is the KV it computes
        assert result["cached_tokens"] == 64 and result["max_logprob_diff"] < 1e-4
    if name == "sidecar_overhead.py":
        assert result["stream_errors"] == 0, result["stream_error_kinds"]
    if name == "routing.py":
        for policy in ("round_robin", "approximate", "precise"):
            keys = {"ttft_p50_ms", "ttft_p90_ms", "hit_rate", "load_max_over_min"}
            assert keys <= result[policy].keys()
    if name == "gguf_to_hf.py":  # the folder's model is transformers' GGUF one
        assert result["max_logit_diff_vs_transformers_gguf"] < 1e-3, result
    if name == "soak.py":  # its checks are properties of the server, not figures
        assert result["ok"], result
    if name == "rag_reuse.py":  # every repair setting reported, and the documents were placed
        assert [r["repair_tokens"] for r in result["settings"]] == [0, 8, 16, 32]
        assert all(r["reused_tokens"] > 0 for r in result["settings"])
    if name == "kv_dtype.py":  # fp8 pages hold 4x fp32's tokens (the page size, not a timing)
        assert result["tokens_per_gib_ratio"] == 4.0
    if name == "burst.py":
        assert result["prompt_tokens_computed"] == result["ideal_tokens"]
        assert result["peak_blocks"] <= result["ideal_blocks"] + 6


@pytest.mark.slow
def test_serving_lengths_reports_the_cached_tokens_of_each_pair() -> None:
    """bench/serving.py's lengths workload against the demo server: B's cached tokens are
    every full block of A that B shares (the server's usage, read from the stream)."""
    args = ["--serve", "demo", "--workload", "lengths", "--lengths", "17", "40", "100"]
    args += ["--vocab", "2000", "--warmup", "1", "--warmup-tokens", "16"]
    result = run_bench("serving.py", args)
    rows = {r["shared"]: r for r in result["rows"]}
    for shared, row in rows.items():
        assert row["cached"] >= shared // 16 * 16, row  # A's full blocks that B shares
        assert row["cached"] <= shared, row
    assert result["zero_hit_lengths"] == []


def test_the_context_plot_reads_the_sweeps_records(tmp_path: Path) -> None:
    """bench/plot_context.py over records shaped as bench/context_sweep.sh writes them."""
    lines = []
    for server, scale in (("llamacpp", 2.0), ("vllm", 1.5), ("prefixcache", 1.0)):
        for context in (1000, 4000):
            ttft = {"A_cold_ms": scale * context, "B_warm_ms": scale * 20.0}
            lines.append(json.dumps({"label": f"{server}/ttft/{context}", **ttft}))
            itl = {"itl_mean_ms": scale * (8 + context / 1000)}
            lines.append(json.dumps({"label": f"{server}/decode/{context}", **itl}))
    records = tmp_path / "sweep.jsonl"
    records.write_text("\n".join(lines) + "\n")
    out = tmp_path / "context.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "plot_context.py"), str(records), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.stat().st_size > 1000
    assert "prefixcache: 1000: 1000.0 (0.50x), 4000: 4000.0 (0.50x)" in proc.stdout
    assert "vllm: 1000: 1500.0 (0.75x), 4000: 6000.0 (0.75x)" in proc.stdout


def test_greedy_answers_pairs_each_kv_run_with_its_own_servers_bf16(tmp_path: Path) -> None:
    """bench/greedy_answers.py compare over records shaped as kv_dtype_vs_vllm.sh writes them:
    each fp8 run against its own server's bf16 answers, the bf16 runs against each other."""
    n = 12
    same = ["a"] * n
    records = [
        {"label": "vllm/auto", "answers": same, "first_tokens": same},
        {"label": "vllm/fp8", "answers": ["a"] * 3 + ["b"] * 9, "first_tokens": same},
        {"label": "prefixcache/auto", "answers": ["a"] * 6 + ["c"] * 6, "first_tokens": same},
        {"label": "prefixcache/fp8", "answers": ["a"] * 6 + ["c"] * 6, "first_tokens": ["x"] * n},
    ]
    runs = tmp_path / "runs.jsonl"
    runs.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "greedy_answers.py"), "compare", str(runs), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["server"], r["vs"]): r for r in json.loads(proc.stdout.splitlines()[-1])["rows"]}
    assert rows["vllm", "vllm/auto"]["agreement"] == 0.25
    assert rows["vllm", "vllm/auto"]["first_token_same"] == 1.0
    assert rows["prefixcache", "prefixcache/auto"]["agreement"] == 1.0
    assert rows["prefixcache", "prefixcache/auto"]["first_token_same"] == 0.0
    assert rows["prefixcache/auto", "vllm/auto"]["agreement"] == 0.5
    assert len(rows) == 3
