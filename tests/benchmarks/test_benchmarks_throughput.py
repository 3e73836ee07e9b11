"""`benchmarks/throughput.py`'s CPU-side pieces: the random corpus a recipe reads, flags, turns and the table."""

import importlib.util
import threading
import time
from pathlib import Path

import pytest

from mhar_lightning.data import TokenDataModule

_PATH = Path(__file__).parents[2] / "benchmarks" / "throughput.py"
_SPEC = importlib.util.spec_from_file_location("throughput", _PATH)
throughput = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(throughput)


def test_random_corpus_is_a_prepared_folder_the_data_module_reads(tmp_path: Path) -> None:
    folder = throughput.random_corpus(tmp_path / "corpus", "byte", 50_000)
    data = TokenDataModule(path=str(folder), tokenizer="byte", seq_len=64, batch_size=4)
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch.shape == (4, 65) and int(batch.max()) < 256
    assert next(iter(data.val_dataloader())).shape == (4, 65)


def test_flags_and_their_errors() -> None:
    parser = throughput.argparse.ArgumentParser()
    assert throughput.flags(["model.compile=false", "data.batch_size=4"], parser) == [
        "--model.compile",
        "false",
        "--data.batch_size",
        "4",
    ]
    with pytest.raises(SystemExit):
        throughput.flags(["model.compile"], parser)


def test_a_recipe_item_splits_at_colons_outside_json_values() -> None:
    residual = '{"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 8, "blocks": 8}}'
    item = f"recipes/study/6m.yaml:model.residual={residual}:model.compile=false"
    want = ["recipes/study/6m.yaml", f"model.residual={residual}", "model.compile=false"]
    assert throughput.recipe_items(item) == want
    assert throughput.recipe_items("recipes/demo.yaml") == ["recipes/demo.yaml"]


def test_turns_wait_for_every_run_then_time_one_at_a_time(tmp_path: Path) -> None:
    """Two runs of a wave: neither times before both are warm, and their timed spans never overlap."""
    spans = {}

    def run(me: int, warmup_s: float) -> None:
        turns = throughput.Turns(str(tmp_path), [0, 1], me)
        time.sleep(warmup_s)
        turns.acquire()
        start = time.monotonic()
        time.sleep(0.2)
        spans[me] = (start, time.monotonic())
        turns.release()
        turns.mark("gone")

    threads = [threading.Thread(target=run, args=(0, 0.0)), threading.Thread(target=run, args=(1, 0.6))]
    begin = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert min(start for start, _ in spans.values()) - begin >= 0.6  # the fast run waited for the slow one's warmup
    (a0, a1), (b0, b1) = sorted(spans.values())
    assert a1 <= b0


def row(recipe: str, preset: str, tok_s: float, peak: float, loop: str = "trainer", probe: float = 0.0) -> dict:
    return {
        "recipe": recipe,
        "loop": loop,
        "preset": preset,
        "compile": True,
        "compiled_autograd": True,
        "tok_s": tok_s,
        "step_ms": 16384 / tok_s * 1e3,
        "mfu": 0.4,
        "peak_gib": peak,
        "probe_s": {"DepthAttentionLogger": probe} if probe else {},
        "every_n_steps": {"DepthAttentionLogger": 1000},
    }


def test_summary_ratios_are_to_the_first_row_of_the_same_loop_and_preset() -> None:
    rows = [
        row("pretrain/350m-sum.yaml", "350m", 160_000, 20.0),
        row("pretrain/350m-mhar.yaml", "350m", 144_000, 21.0, probe=1.024),
        row("pretrain/1b-sum.yaml", "1b", 70_000, 28.0),
        row("pretrain/1b-mhar.yaml", "1b", 63_000, 29.4),
        row("pretrain/350m-sum.yaml", "350m", 170_000, 20.0, loop="bare"),
        row("pretrain/350m-hc.yaml", "350m", 96_000, 30.0) | {"compiled_autograd": False},  # its recipe's options
    ]
    cells = {
        (line.split("|")[1].strip(), line.split("|")[2].strip()): [c.strip() for c in line.split("|")[3:-1]]
        for line in throughput.summary(rows).splitlines()[2:]
    }
    assert cells[("pretrain/350m-mhar.yaml", "trainer")][:2] == ["144,000", "0.900"]
    assert cells[("pretrain/350m-mhar.yaml", "trainer")][4:6] == ["21.00", "1.050"]
    # one probe of 1.024 s every 1000 steps of 16384 / 144000 s: 0.90 % of the steps' time
    assert cells[("pretrain/350m-mhar.yaml", "trainer")][6] == "DepthAttentionLogger 1024 ms (0.90 %)"
    assert cells[("pretrain/1b-mhar.yaml", "trainer")][:2] == ["63,000", "0.900"]
    assert cells[("pretrain/350m-sum.yaml", "bare")][:2] == ["170,000", "1.000"]
    assert cells[("pretrain/350m-hc.yaml", "trainer")][:2] == ["96,000", "0.600"]
    assert cells[("pretrain/350m-hc.yaml", "trainer")][4:6] == ["30.00", "1.500"]


def test_kernels_are_sorted_into_kinds_by_name() -> None:
    names = {
        "_forward_kernel": "routing",
        "_backward_stats_kernel": "routing",
        "_backward_apply_kernel": "routing",
        "_merge_norm_backward_kernel": "routing",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "compiled",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "matmul",  # noqa: E501
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>": "attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "Memcpy DtoD (Device -> Device)": "copy",
        "Memset (Device)": "copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
    }
    assert {name: throughput.kernel_kind(name) for name in names} == names


def test_the_kernel_breakdown_is_device_time_a_step_by_kind() -> None:
    kernels = [  # (name, calls, total us) over 2 steps
        ("_forward_kernel", 48, 5_000.0),
        ("_backward_apply_kernel", 48, 7_000.0),
        ("triton_poi_fused_add_0", 200, 3_000.0),
        ("nvjet_tst_128x256", 300, 150_000.0),
        ("Memset (Device)", 10, 20.0),
    ]
    breakdown = throughput.kernel_breakdown(kernels, steps=2, top=2)
    assert breakdown["kinds"] == {"matmul": 75.0, "routing": 6.0, "compiled": 1.5, "copy": 0.01}
    assert list(breakdown["kinds"]) == ["matmul", "routing", "compiled", "copy"]  # costliest first
    assert breakdown["step_ms"] == pytest.approx(82.51)
    assert breakdown["top"] == [
        ["nvjet_tst_128x256", "matmul", 75.0, 150.0],
        ["_backward_apply_kernel", "routing", 3.5, 24.0],
    ]


def test_the_summary_adds_a_table_of_kernel_kinds_for_profiled_rows() -> None:
    kernels = {"step_ms": 100.0, "kinds": {"matmul": 80.0, "routing": 20.0}, "top": []}
    rows = [
        row("pretrain/350m-sum.yaml", "350m", 160_000, 20.0),
        row("pretrain/350m-mhar.yaml", "350m", 144_000, 21.0),
        row("pretrain/1b-mhar.yaml", "1b", 60_000, 30.0),
    ]
    assert "kind of kernel" not in throughput.summary(rows)
    rows[0] |= {"kernels": {"step_ms": 90.0, "kinds": {"matmul": 80.0, "compiled": 10.0}, "top": []}}
    rows[1] |= {"kernels": kernels}
    rows[2] |= {"kernels": kernels}
    table = throughput.summary(rows).split("speed in device time:")[1].strip().splitlines()
    assert table[0] == "| recipe | compiled | matmul | routing | all | x first |"
    assert table[2] == "| pretrain/350m-sum.yaml | 10.00 | 80.00 | 0.00 | 90.00 | 1.000 |"
    assert table[3] == "| pretrain/350m-mhar.yaml | 0.00 | 80.00 | 20.00 | 100.00 | 0.900 |"
    assert table[4] == "| pretrain/1b-mhar.yaml | 0.00 | 80.00 | 20.00 | 100.00 | 1.000 |"  # its own preset's first
    assert len(table) == 5
