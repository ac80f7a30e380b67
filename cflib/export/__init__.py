"""export: the trained model leaving the project.

Owns the Hugging Face Hub bundle (`python -m cflib.export hub CHECKPOINT OUT`,
`export_hub` in Python), its tokenizer files and the modules it carries
(`hub_modules/`, copied verbatim into the bundle and importing no cflib code),
loading a bundle into transformers with those modules and none of its own
(`bundle`), LoRA adapters in PEFT's format with their merge into the base (`peft`;
`python -m cflib.export merge ADAPTER OUT`); the model card of a bundle or of
adapters (`model_card`), publishing them on the Hub (`publish`; `python -m
cflib.export adapters ADAPTER OUT`, `--push ORG/NAME`) through
`huggingface_hub` (`push`). Imports model, data and the foundation modules;
never train, bench or lab.
"""
from cflib.export.hub import ExportError, export_hub, resolve_checkpoint
from cflib.export.publish import export_adapters, publish_run
from cflib.export.push import PushError, push_folder
from cflib.export.tokenizer_files import TokenizerExportError

__all__ = ["ExportError", "PushError", "TokenizerExportError", "export_adapters", "export_hub", "publish_run",
           "push_folder", "resolve_checkpoint"]
