"""benchmarks/generation_memory.py: its allocation accounting on a snapshot of known contents, and its CPU smoke run."""

from _benchmarks import load_benchmark

MIB = 2**20


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def test_origin_names_the_innermost_known_frame_and_ours_that_led_there():
    benchmark = load_benchmark("generation_memory")
    peft = frame("/venv/lib/python3.12/site-packages/peft/tuners/lora/layer.py", 1088, "forward")
    ours = frame("/work/main/prorl_trl/rollout/decoder.py", 186, "prefill")
    python = frame("/usr/lib/python3.12/threading.py", 1, "run")
    assert benchmark.origin([python, peft, ours]) == (
        "peft/tuners/lora/layer.py:1088 forward (from main/prorl_trl/rollout/decoder.py:186 prefill)"
    )
    assert benchmark.origin([ours]) == "main/prorl_trl/rollout/decoder.py:186 prefill"
    assert benchmark.origin([python]) == "/usr/lib/python3.12/threading.py:1 run"
    assert benchmark.origin([]) == "(no Python frame: C++)"


def test_kept_allocations_counts_active_blocks_by_origin_and_reserved_bytes_by_pool():
    benchmark = load_benchmark("generation_memory")
    fuse = [frame("/work/main/prorl_trl/rollout/fused_weights.py", 137, "copy_members")]
    snapshot = {"segments": [
        {"segment_pool_id": (0, 0), "stream": 0, "total_size": 64 * MIB, "blocks": [
            {"state": "active_allocated", "size": 32 * MIB, "frames": fuse},
            {"state": "active_allocated", "size": 8 * MIB, "frames": fuse},
            {"state": "inactive", "size": 24 * MIB, "frames": fuse},
        ]},
        {"segment_pool_id": (0, 0), "stream": 12345, "total_size": 2 * MIB, "blocks": [
            {"state": "active_allocated", "size": 2 * MIB, "frames": []},
        ]},
        {"segment_pool_id": (1, 0), "stream": 12345, "total_size": 20 * MIB, "blocks": [
            {"state": "inactive", "size": 20 * MIB, "frames": []},
        ]},
    ]}  # fmt: skip
    kept = benchmark.kept_allocations(snapshot)
    assert kept["private_reserved"] == 20 * MIB
    assert kept["default_stream_reserved"] == 64 * MIB and kept["other_streams_reserved"] == 2 * MIB
    assert kept["by_origin"] == [
        ("default", "main/prorl_trl/rollout/fused_weights.py:137 copy_members", 40 * MIB, 2),
        ("default", "(no Python frame: C++)", 2 * MIB, 1),
    ]


def test_smoke_run_renders_a_row_per_phase_and_method(capsys):
    benchmark = load_benchmark("generation_memory")
    rows = benchmark.main(["--smoke", "--phases", "reset-3", "--methods", "rollout_engine"])
    assert [(r["phase"], r["method"]) for r in rows] == [("reset-3", "rollout_engine")]
    assert "error" not in rows[0]
    assert "| reset-3 | rollout_engine | (CPU) |" in capsys.readouterr().out
