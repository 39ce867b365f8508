"""The benchmarks run end to end (small versions: the
numbers themselves are for `python bench/...`, not for a test)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.bench import run_bench

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """Where the benchmarks keep the models they build, reused by the rest;
    their "tiny" is the suite's own tiny LLaVA (the same build)."""
    kept = tmp_path_factory.mktemp("bench-models")
    (kept / "model-tiny").symlink_to(tiny_model)
    return kept


def test_engine_benchmark_prints_every_ratio(models: Path) -> None:
    args = ["--models", "tiny", "--tp", "1", "--n", "4", "--tokens", "4", "--rounds", "1"]
    result = run_bench("engine.py", args, models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    for column in ("c=1 / serial", "c=8 / batch", "c=4 / batch", "c=4 / batch+prep", "TTFT ms", "ITL ms", "= HF"):
        assert column in result.stdout
    row = [line for line in result.stdout.splitlines() if line.startswith("tiny ")][-1]  # the table's
    assert row.split()[-1] == "4/4", "the services' greedy tokens equal HF's"
    assert "CPU seconds at 4 concurrent" in result.stdout
    assert re.search(
        r"^  CPU at 4 concurrent: [\d.]+ CPU-s in [\d.]+ s on \d+ cores \(\d+% of what they give\); the scheduler "
        r"[\d.]+ against HF batch's generate [\d.]+ CPU-s in [\d.]+ s; "
        r"the other parts [\d.]+ CPU-s .* would be [\d.]+$",
        result.stdout,
        re.M,
    ), result.stdout
    assert re.search(r"^  c=4 / HF batch round by round: [\d.]+ \(median [\d.]+;", result.stdout, re.M), result.stdout
    # Every services run sends new images: no cache spares the services work the HF arms do.
    assert "cache hits over the timed services runs (new images in each): preprocess 0, encoder 0, prefix 0" in (
        result.stdout
    )


def test_multiturn_benchmark_prints_every_figure_and_both_arms_agree(models: Path) -> None:
    args = ["--conversations", "1", "--system", "16", "--answer", "2", "--rounds", "1", "--no-chunked"]
    args += ["--model", "tiny", "--unshared-repeats", "2"]
    result = run_bench("multiturn.py", args, models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    for line in (
        "TTFT on ms",
        "turns 2-4: TTFT with the cache",
        "prompt tokens taken from the cache",
        "shared system prompt, staggered",
        "shared system prompt, at once",
        "waiting for the shared prefill: all done in",
    ):
        assert line in result.stdout
    unshared = r"no shared prefix \(1 x 4 requests of \d+-\d+ tokens, 2 runs of each arm\): tokens/s on \d+, off \d+ "
    unshared += r"\([\d.]+x; target >= 0.97x\); on/off of each pair run together: median [\d.]+, [\d.]+-[\d.]+$"
    assert re.search(unshared, result.stdout, re.M), result.stdout
    shared = r"identical prompts at once \(2 requests of one 111-token prompt with an image, queued together "
    shared += r"through the step loop, "
    assert re.search(shared + r"as n choices are\): TTFT prefilled once \d+ ms, each its own \d+ ms \([\d.]+x\)$",
                     result.stdout, re.M), result.stdout  # fmt: skip
    chunked = r"as n choices are, prefilled in chunks of 28\): TTFT prefilled once \d+ ms, each its own \d+ ms"
    assert re.search(shared + chunked + r" \([\d.]+x\)$", result.stdout, re.M), result.stdout
    assert "same tokens with the cache on and off, shared or not (every request, every round): True" in result.stdout


def test_chat_turns_benchmark_prints_every_turn_and_both_arms_agree(
    models: Path, chat_models: Callable[[str], Path]
) -> None:
    """Through the OpenAI API and both services: every later turn takes
    part of its prompt from the cache (the usage says so), the arm without
    the cache reports none, and both give the same greedy answers."""
    if not (models / "model-tiny-chat").exists():
        (models / "model-tiny-chat").symlink_to(chat_models("llava"))  # the same build as the bench's
    args = ["--model", "tiny", "--conversations", "1", "--system", "20", "--answer", "2", "--rounds", "1"]
    result = run_bench("chat_turns.py", args, models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^([1-4])\s+\d+\s+\d+\s+[\d.]+x\s+(\d+)%$", result.stdout, re.M)
    assert [turn for turn, _ in rows] == ["1", "2", "3", "4"], result.stdout
    assert all(int(share) > 0 for _, share in rows[1:]), result.stdout
    assert re.search(r"^turns 2-4: TTFT with the cache [\d.]+-[\d.]+x of without$", result.stdout, re.M)
    assert "cached tokens reported with the cache off: 0" in result.stdout
    assert "same answers with the cache on and off (every conversation, every round): True" in result.stdout


@pytest.mark.parametrize(
    ("api", "answers"),
    [
        ("http", "given back: {200: 2, 400: 2}; kept: {200: 2, 400: 2}"),
        ("grpc", "given back: {'INVALID_ARGUMENT': 2, 'OK': 2}; kept: {'INVALID_ARGUMENT': 2, 'OK': 2}"),
    ],
)
def test_heap_bound_benchmark_prints_both_arms_every_round(
    models: Path, chat_models: Callable[[str], Path], api: str, answers: str
) -> None:
    """Both tokenizers answer every request (the valid images 200 or OK,
    the others 400 or INVALID_ARGUMENT) and their resident memory is read
    after each round."""
    if not (models / "model-tiny-chat").exists():
        (models / "model-tiny-chat").symlink_to(chat_models("llava"))  # the same build as the bench's
    args = ["--rounds", "1", "--requests", "4", "--concurrency", "2", "--image-mb", "0.5", "--settle-s", "0"]
    result = run_bench("heap_bound.py", [*args, "--api", api], models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^at rest: given back \d+ MB, kept \d+ MB$", result.stdout, re.M), result.stdout
    assert re.search(r"^1\s+\d+\s+\d+\s+[\d.]+$", result.stdout, re.M), result.stdout
    assert f"answers: {answers}" in result.stdout, result.stdout


def test_heap_bound_benchmark_s_scheduler_part_prints_both_arms(family_models: Callable[[str], Path]) -> None:
    """The suite's tiny Qwen2-VL (its own small pixel budget) and small
    images: both schedulers answer every request, inline (each service with
    a /dev/shm of its own), and their resident memory is read."""
    args = ["--service", "scheduler", "--model", str(family_models("qwen2-vl")), "--image-size", "160x120"]
    args += ["--rounds", "1", "--requests", "2", "--concurrency", "2", "--settle-s", "0"]
    result = run_bench("heap_bound.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the scheduler's resident MB (rank 0, TP=1)" in result.stdout, result.stdout
    assert re.search(r"^at rest: given back \d+ MB, kept \d+ MB$", result.stdout, re.M), result.stdout
    assert re.search(r"^1\s+\d+\s+\d+\s+[\d.]+$", result.stdout, re.M), result.stdout
    assert "answers: given back: {200: 2}; kept: {200: 2}" in result.stdout


def test_stream_hold_benchmark_reads_both_services_while_every_stream_runs(models: Path) -> None:
    """Both sets of streams are read while they run (a round whose streams
    end first fails) and the table has its round; with `--inline` (its
    other arm differs only by the wrapper and the rank's columns), the
    services each in a /dev/shm of its own, the scheduler's columns too."""
    args = ["--streams", "2", "--tokens", "2000", "--image-mb", "0.3", "--rounds", "1", "--settle-s", "0.2", "--inline"]
    result = run_bench("stream_hold.py", args, models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensors inline" in result.stdout
    number = r"\s+-?[\d.]+"
    assert re.search(rf"^1{number * 8}$", result.stdout, re.M), result.stdout


def test_shared_prefix_benchmark_prints_both_arms_and_their_ratios(models: Path) -> None:
    args = ["--model", "tiny", "--n", "4", "--system", "80", "--tokens", "2", "--rounds", "1"]
    result = run_bench("shared_prefix.py", args, models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith(("waits ", "no wait "))}
    assert rows.keys() == {"waits", "no"}
    assert "waiting / not waiting: TTFT p50" in result.stdout


def test_beam_search_benchmark_prints_every_arm_and_finds_transformers_beams(models: Path) -> None:
    args = ["--model", "tiny", "--width", "2", "--tokens", "3", "--rounds", "1"]
    result = run_bench("beam_search.py", args, models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    for line in ("services, beam search", "services, n=2 sampled", "transformers' beam search, in process"):
        assert line in result.stdout
    assert "beam search, services / transformers in process:" in result.stdout
    assert "the services' beams are transformers': 2/2" in result.stdout


def test_tp_sums_benchmark_prints_both_ways_for_every_size() -> None:
    result = run_bench("tp_sums.py", ["--reps", "20"])
    assert result.returncode == 0, result.stderr[-3000:]
    for size in ("1 row x 512", "32 rows x 512", "1024 rows x 512", "> a slot"):
        row = next(line for line in result.stdout.splitlines() if line.startswith(size))
        assert row.endswith("x"), row  # gloo / shm, both measured


def test_grpc_floor_benchmark_prints_every_arm() -> None:
    result = run_bench("grpc_floor.py", ["--intervals-ms", "20", "--seconds", "0.2", "--rounds", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line[:20].strip(): line.split()[-5:] for line in result.stdout.splitlines()[3:]}
    assert rows.keys() == {"back to back", "every 20 ms", "open, silent (per s)"}, result.stdout
    assert rows["back to back"][-1] == "1.0"
    assert float(rows["every 20 ms"][-1]) > 0  # its CPU per message against back to back's, both measured
    assert [rows["every 20 ms"][1], rows["back to back"][1]] == ["10", "400"]  # messages: every one came


def test_parsers_benchmark_prints_both_splits_and_every_prompt_length() -> None:
    result = run_bench("parsers.py", ["--reps", "1", "--rounds", "1", "--openings", "50"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^20 calls(\s+[\d.]+){4}$", result.stdout, re.M), result.stdout
    assert re.search(r"^50 unclosed, [\d,]+ chars(\s+[\d.]+){4}$", result.stdout, re.M), result.stdout
    for n in ("1,000", "10,000", "100,000"):
        assert re.search(rf"^{n}(\s+[\d.]+){{4}}$", result.stdout, re.M), result.stdout


def test_sampler_benchmark_prints_both_picks_for_every_shape() -> None:
    result = run_bench("sampler.py", ["--reps", "3", "--rounds", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    for vocab in ("llava-1.5", "qwen2-vl"):
        for rows in (1, 8, 32):
            row = next(line for line in result.stdout.splitlines() if line.startswith(f"{vocab} {rows} rows"))
            assert row.endswith("x"), row
        assert f"32 greedy rows under min_tokens, {vocab}:" in result.stdout
        assert re.search(rf"^{vocab}\s+\d+\s+\d+\s+[\d.]+x\s+-?[\d.]+$", result.stdout, re.M), result.stdout


def test_gc_pause_benchmark_prints_both_heaps(models: Path) -> None:
    # Its second part reads the services' gc metrics, which tests/e2e/test_metrics.py checks.
    result = run_bench("gc_pause.py", ["--model", "tiny", "--reps", "1", "--rounds", "0"], models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for service in ("tokenizer", "scheduler"):
        heap = next(line for line in lines if line.startswith(f"{service} ") and len(line.split()) == 6)
        assert float(heap.split()[2]) > 100_000, heap  # the start-up, frozen


def test_processor_steps_benchmark_prints_every_arm(models: Path) -> None:
    result = run_bench("processor_steps.py", ["--families", "llava,qwen2-vl", "--reps", "1"], models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensors equal" in result.stdout
    for label in ("llava", "qwen2-vl", "qwen2-vl, default budget"):
        for size in ("640x480", "1280x720", "1920x1080", "all three"):
            row = rf"^{label}\s+{size}(\s+[\d.]+){{3}}\s+[\d.]+x\s+[\d.]+x$"
            assert re.search(row, result.stdout, re.M), result.stdout
    assert "video rows at the default per-frame budget, fastest of each; rows equal" in result.stdout
    for frames in (8, 20):
        assert re.search(rf"^{frames} frames(\s+[\d.]+){{3}}\s+[\d.]+x\s+[\d.]+x$", result.stdout, re.M), result.stdout


def test_image_rows_benchmark_prints_both_forms_in_process_and_through_the_services(models: Path) -> None:
    # The services' part 2 (the forms) alone: part 3 is the same function
    # with other arms and larger images (each part starts two pairs of
    # services; part 3 took 20 of the 34 s the two took here).
    args = ["--reps", "1", "--rounds", "1", "--n", "2", "--concurrency", "1", "--parts", "forms"]
    result = run_bench("image_rows.py", args, models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    for dtype in ("float32", "bfloat16"):
        assert f"a {dtype} model: per image, fastest of 1 (the model's inputs equal)" in result.stdout
    for size in ("640x480", "1280x720", "1920x1080"):
        for form in ("both frames", "one frame"):
            assert len(re.findall(rf"^{size}\s+{form}(\s+[\d.]+){{6}}$", result.stdout, re.M)) == 2, result.stdout
    for ratio in ("0.50", "0.25"):  # one frame; and in bfloat16
        found = re.findall(rf"^\s+one / both\s+{ratio}(\s+[\d.]+){{5}}$", result.stdout, re.M)
        assert len(found) == 3, result.stdout
    for arm in ("both frames", "one frame"):
        assert re.search(rf"^{arm}(\s+[\d.]+){{5}}$", result.stdout, re.M), result.stdout
    assert re.search(r"^one frame / both frames: [\d.]+x the requests/s$", result.stdout, re.M), result.stdout
    assert "glibc's defaults" not in result.stdout


def test_step_profile_prints_the_step_and_its_ops(models: Path) -> None:
    """The profile a GPU session runs (tests/gpu/run.sh), here on the CPU."""
    args = ["--model", "tiny", "--rows", "4", "--steps", "2", "--rounds", "1", "--arms"]
    result = run_bench("step_profile.py", args, models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    arm = r"[\d.]+ \([\d.]+x\)"
    padded = "keys padded to 64"
    arms = rf"cuDNN off \(default\) {arm}, cuDNN on {arm}, cuDNN off, {padded} {arm}, cuDNN on, {padded} {arm}$"
    assert re.search(arms, result.stdout, re.M), result.stdout
    assert re.search(r"decode step wall ms, median: [\d.]+ without the profiler, [\d.]+ with it", result.stdout)
    lean = rf"median of 1 rounds: the model's own forward [\d.]+, lean {arm}$"
    assert re.search(lean, result.stdout, re.M), result.stdout
    assert re.search(r"^aten::mm\s+\d+\s+[\d.]+$", result.stdout, re.M), result.stdout
    floors = (
        r"^the step's floors on \d+ threads: its matrix products read [\d.]+ MB of weights \(\d+ of them\) .* "
        r"the step [\d.]+ ms is [\d.]+x the larger floor \((reading|arithmetic)\)$"
    )
    assert re.search(floors, result.stdout, re.M), result.stdout


def test_structured_benchmark_prints_the_step_and_the_join(models: Path) -> None:
    result = run_bench("structured.py", ["--rows", "4", "--reps", "2", "--rounds", "1"], models=models)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^json_schema\s+[\d.]+\s+[\d.]+x$", result.stdout, re.M), result.stdout
    assert re.search(r"^48 KB, 600 patterns\s+\d+\s+[\d.]+\s+[\d.]+$", result.stdout, re.M), result.stdout


def test_trim_stall_benchmark_prints_the_wait_with_and_without_a_trim() -> None:
    result = run_bench("trim_stall.py", ["--mib", "64", "--rounds", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("64 "))
    held, given_back = (float(v) for v in row.split()[1:3])
    assert held >= 48, row  # the holes were there
    assert given_back >= 48, row  # and the trim gave them back
    assert row.endswith("x"), row  # the wait with a trim against without, both measured
