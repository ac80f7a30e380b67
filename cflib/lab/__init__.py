"""lab: what a person sees in JupyterLab.

Owns the parameter forms (`form`), the views of a training run (`report`)
and of a curriculum's stages (`curricula`),
sweeps of train_sft runs (`sweep`, `sweep_run`) and their comparison (`compare`),
chatting with a checkpoint (`chat`, `chat_box`), lm-evaluation-harness on a
model's Hub bundle (`evaluate`), starting JupyterLab with the
project's kernel (`python -m cflib.lab`) and cleaning notebooks before a
commit (`python -m cflib.lab.nbclean`). The top layer: it may import every
other part of cflib; nothing imports it.

Its names load on first use (cflib.lazy): `python -m cflib.lab.nbclean`, a commit hook, starts without torch.
"""
from __future__ import annotations

from cflib.lazy import lazy_names

_MODULE_OF = {
    **dict.fromkeys(["plot_run_curves", "plot_stage_curves", "stage_table"], "cflib.lab.curricula"),
    **dict.fromkeys(["compare_form", "sweep_form", "throughput_form", "train_form", "tune_form", "validate_form"],
                    "cflib.lab.form"),
    **dict.fromkeys(["export_run", "headline", "plot_loss_curves", "plot_loss_weighting", "show_answers", "show_data",
                     "show_exact_match", "show_samples", "size_like_this_run", "summary"], "cflib.lab.report"),
}
__all__ = sorted(_MODULE_OF)
__getattr__, __dir__ = lazy_names(__name__, _MODULE_OF)
