"""model: the TR-MoE decoder and its public checkpoint layout.

Owns the configuration (`config`), RoPE's frequencies and their scalings
(`rope`), the deterministic route tables (`routing`), the reference decoder
in plain PyTorch (`decoder`) and its fast modules (`fast`), LoRA (`lora`),
the KV-cache decoder (`generate`),
reading and writing checkpoints (`checkpoint`), and the derived buffers
every written checkpoint carries for the published adapter (`derived`).
Imports `cflib.ops` and the foundation modules only; never data, training or
measuring code.
"""
from cflib.model.checkpoint import CheckpointError, load_checkpoint, load_config, save_checkpoint
from cflib.model.config import PRESETS, ConfigError, ModelConfig, preset
from cflib.model.decoder import TRMoEModel
from cflib.model.derived import derived_buffers, fused_route_buffers

__all__ = ["PRESETS", "CheckpointError", "ConfigError", "ModelConfig", "TRMoEModel", "derived_buffers",
           "fused_route_buffers", "load_checkpoint", "load_config", "preset", "save_checkpoint"]
