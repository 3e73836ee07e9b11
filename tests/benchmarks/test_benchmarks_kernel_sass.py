"""`benchmarks/kernel_sass.py`: loops and opcode counts of a hand-written SASS listing, and a real compilation of
two routing kernels for sm_90 on this machine (no GPU), whose loops show what the kernels are known to do."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).parents[2] / "benchmarks" / "kernel_sass.py"
_SPEC = importlib.util.spec_from_file_location("kernel_sass", _PATH)
kernel_sass = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(kernel_sass)

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                       /* 0x0000000000007919 */
        /*0020*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;         /* 0x0000000402048981 */
        /*0030*/                   SHFL.BFLY PT, R5, R4, 0x10, 0x1f ;       /* 0x0e001f0004057f89 */
        /*0040*/                   FADD R6, R4, R5 ;                        /* 0x0000000504067221 */
        /*0050*/                   LDL R7, [R1+0x10] ;                      /* 0x0000100001077983 */
        /*0060*/               @P1 BRA 0x20 ;                               /* 0xfffffffc00ec1947 */
        /*0070*/                   FFMA R8, R6, R6, R7 ;                    /* 0x0000000706087223 */
        /*0080*/               @P2 BRA 0x70 ;                               /* 0xfffffffc00ec2947 */
        /*0090*/                   BRA 0xa0 ;                               /* 0x0000000000007947 */
        /*00a0*/                   EXIT ;                                   /* 0x000000000000794d */
"""


def test_loops_of_a_listing_are_its_backward_branches_with_their_opcodes() -> None:
    listing = kernel_sass.instructions(LISTING)
    assert [a for a, _ in listing] == list(range(0, 0xB0, 0x10))
    assert kernel_sass.opcode(listing[2][1]) == "LDG"
    found = kernel_sass.loops(listing)
    assert [(loop["start"], loop["end"], loop["instructions"]) for loop in found] == [(0x20, 0x60, 5), (0x70, 0x80, 2)]
    assert [loop["main"] for loop in found] == [5, 2]  # no forward branch inside either loop
    first = found[0]
    assert (first["LDG"], first["SHFL"], first["FADD"], first["LDL"], first["FFMA"]) == (1, 1, 1, 1, 0)
    assert found[1]["FFMA"] == 1
    assert "| forward | 64 | 1 | 1 | 40 | 0 | 5 | 5 | 1 | 0 | 1 |" in kernel_sass.table(
        [{"kernel": "forward", "d": 64, "queries": 1, "warps": 1, "registers": 40, "stack_bytes": 0, "loops": found}]
    )


BRANCHY = """
        /*0000*/                   FADD R6, R4, R5 ;
        /*0010*/              @!P0 BRA 0x40 ;
        /*0020*/                   FMUL R7, R7, R6 ;
        /*0030*/                   FMUL R8, R8, R6 ;
        /*0040*/                   FFMA R9, R6, R6, R9 ;
        /*0050*/               @P1 BRA 0x0 ;
        /*0060*/                   EXIT ;
"""


def test_the_main_path_leaves_out_what_a_forward_branch_in_the_loop_skips() -> None:
    (loop,) = kernel_sass.loops(kernel_sass.instructions(BRANCHY))
    assert (loop["instructions"], loop["main"], loop["FMUL"]) == (6, 4, 2)


def test_the_routing_kernels_compile_for_sm90_without_a_gpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "rows.json"
    args = ["--d", "64", "--heads", "2", "--queries", "2", "--kernels", "forward", "apply", "--out", str(out)]
    run = subprocess.run([sys.executable, str(_PATH), *args], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {row["kernel"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"forward", "apply"}
    for row in rows.values():
        assert 0 < row["registers"] <= 255 and row["stack_bytes"] == 0 and row["loops"]
    forward, apply = rows["forward"]["loops"][0], rows["apply"]["loops"][0]
    assert forward["SHFL"] > 0 and forward["MUFU"] > 0  # per-head logits reduce across lanes; exp and rsqrt
    assert apply["SHFL"] == 0 and apply["STG"] > 0  # the gradient kernel only scales and adds rows, and stores them
    assert forward["main"] < forward["instructions"]  # a pass skips the lazy rescaling of the one-warp forward
    assert "| forward | 64 | 2 |" in run.stdout


def test_the_interpreter_is_refused() -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(_PATH)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unset TRITON_INTERPRET" in run.stderr


def test_launch_specialisation_marks_aligned_pointers_and_multiples_of_16() -> None:
    fn, constexprs, _ = kernel_sass.launch_settings("forward", 1024, 8, 2)
    values = kernel_sass.scalars(1024, 8, 5, 16384, 2048) | {"S1": 1}
    signature, constexprs, attrs = kernel_sass.specialise(fn, constexprs, values)
    names = fn.arg_names
    divisible = {names[index] for (index,), attr in attrs.items() if attr == [["tt.divisibility", 16]]}
    assert divisible == {"table", "u_ptr", "out0_ptr", "out1_ptr", "lse_ptr", "rms_ptr", "M", "M1", "D", "DH"}
    assert signature["S"] == "i32" and signature["eps"] == "fp32" and signature["out0_ptr"] == "*bf16"
    assert signature["S1"] == "constexpr" and constexprs["S1"] == 1  # Triton makes an integer 1 a constant
    assert constexprs["Q"] == 2 and signature["Q"] == "constexpr"
