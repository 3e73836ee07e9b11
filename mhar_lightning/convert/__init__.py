"""Import Hugging Face Llama checkpoints into any residual strategy, and export `sum` models back.

Converted-checkpoint format (a directory; `save_converted` writes it, `load_converted` reads it):

    mhar_config.json    {"format_version": 1,
                         "model": {ModelConfig fields},
                         "residual": {"class_path": "mhar_lightning.residual.DeltaMHAR",
                                      "init_args": {"heads": 8, "block_size": 4}},
                         "dtype": "bfloat16",
                         "source": {"path": ..., "hf_config": {the source config.json}}}
    model.safetensors   every parameter under `Decoder.state_dict()` names, routing included
                        (a tied head is stored once, as `embed.weight`); or, above `max_shard_size`,
    model-0000k-of-0000n.safetensors + model.safetensors.index.json   ({"metadata": {"total_size"},
                        "weight_map": {name: file}}, the Hugging Face layout)

The source's tokenizer files (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`,
`tokenizer.model`, `original/tokenizer.model`) are copied alongside, so the directory serves as both
`model.init_from` and `data.tokenizer`. `mhar_config.json` is written last: a directory without it is an
interrupted conversion. `"model"` holds every `ModelConfig` field (vocabulary, norm eps, RoPE theta and
scaling, head size, biases, tied head), so a run takes the whole shape from it (`pretrained_model`).
Rebuild the model with `Decoder(ModelConfig(**model), make_residual(residual))`; then the state
dict loads strictly (`converted_state_dict`, memory-mapped).
"""

from mhar_lightning.convert.checkpoint import (
    converted_state_dict,
    load_converted,
    load_decoder,
    load_hf_llama,
    save_converted,
)
from mhar_lightning.convert.export import export_hf
from mhar_lightning.convert.hf_llama import hf_config_to_model_config
from mhar_lightning.convert.pretrained import check_data_tokenizer, pretrained_model
from mhar_lightning.convert.safetensors_io import ConversionError

__all__ = [
    "ConversionError",
    "check_data_tokenizer",
    "converted_state_dict",
    "export_hf",
    "hf_config_to_model_config",
    "load_converted",
    "load_decoder",
    "load_hf_llama",
    "pretrained_model",
    "save_converted",
]
