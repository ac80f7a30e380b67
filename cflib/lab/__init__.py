"""lab: what a person sees in JupyterLab.

Owns the parameter forms (`form`), the views of a training run (`report`)
and of a curriculum's stages (`curricula`),
sweeps of train_sft runs (`sweep`, `sweep_run`) and their comparison (`compare`),
chatting with a checkpoint (`chat`, `chat_box`), lm-evaluation-harness on a
model's Hub bundle (`evaluate`), starting JupyterLab with the
project's kernel (`python -m cflib.lab`) and cleaning notebooks before a
commit (`python -m cflib.lab.nbclean`). The top layer: it may import every
other part of cflib; nothing imports it.
"""
from cflib.lab.curricula import plot_run_curves, plot_stage_curves, stage_table
from cflib.lab.form import compare_form, sweep_form, throughput_form, train_form, tune_form, validate_form
from cflib.lab.report import (
    export_run,
    headline,
    size_like_this_run,
    plot_loss_curves,
    plot_loss_weighting,
    show_answers,
    show_data,
    show_exact_match,
    show_samples,
    summary,
)

__all__ = ["compare_form", "sweep_form", "export_run", "headline", "size_like_this_run", "plot_loss_curves",
           "plot_loss_weighting", "plot_run_curves", "plot_stage_curves", "show_answers", "stage_table",
           "show_data", "show_exact_match", "show_samples", "summary", "throughput_form", "train_form", "tune_form",
           "validate_form"]
