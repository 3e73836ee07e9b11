"""`ParameterSummary`: one line with the model's and the routing's parameter counts, instead of Lightning's table."""

from types import SimpleNamespace

from lightning.pytorch.utilities.model_summary import get_human_readable_count
from mhar_lightning.callbacks import ParameterSummary

from mhar_lightning.module import LanguageModel
from mhar_lightning.parallel import routing_parameter_count

MHAR = {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 4, "blocks": None}}


def test_one_line_with_model_and_routing_parameters(capsys) -> None:
    model = LanguageModel(preset="tiny", residual=MHAR, vocab_size=256, seq_len=32)
    model.configure_model()
    ParameterSummary().on_fit_start(SimpleNamespace(), model)
    routing = routing_parameter_count(model.model_config, model.residual)  # built apart, on the meta device
    total = model.model_config.num_params() + routing
    assert routing == 9 * 2 * 64  # a query and a key gain of width 64 per routing site (8 sublayers + final)
    assert capsys.readouterr().out == (
        f"model: {get_human_readable_count(total)} parameters (routing {get_human_readable_count(routing)}), "
        f"{total * 4 / 2**20:,.1f} MiB in fp32\n"
    )
