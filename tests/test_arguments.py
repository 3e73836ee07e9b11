"""The tools' command lines through `mhar`: a mistyped option is one line that names the option meant."""

import pytest

from mhar_lightning.cli import main


@pytest.mark.parametrize(
    "argv, unknown, meant",
    [
        (["generate", "run.ckpt", "--promt", "Once"], "--promt", "--prompt"),  # before the missing --prompt
        (["evaluate", "run.ckpt", "--dat", "data"], "--dat", "--data"),
        (["inspect", "run.ckpt", "--outt", "maps.png"], "--outt", "--out"),
        (["compare", "sum", "--seed", "1"], "--seed 1", "--seeds"),  # argparse's own check: the value comes along
        (["consolidate", "sharded", "out.ckpt", "--dtyp=bfloat16"], "--dtyp=bfloat16", "--dtype"),
    ],
)
def test_a_mistyped_option_names_the_closest_in_one_line(argv: list[str], unknown: str, meant: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == f"mhar {argv[0]}: error: unrecognized arguments: {unknown}; did you mean {meant}?\n"


def test_a_missing_option_is_one_line_too(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", "run.ckpt"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "mhar generate: error: the following arguments are required: --prompt\n"
