"""The positions a run trains: the starting model's RoPE and context with the run's `rope_scaling`, `rope_theta` and
`max_position_embeddings` (docs/parameters.md#longer-context-rope-scaling).

A run that names none of them trains the starting model's own (a checkpoint's, a resumed checkpoint's or a
preset's). `rope_scaling` sets the model's scaling (never compounds it: a checkpoint already scaled so is left as it
is), `rope_theta` its base; `max_position_embeddings`, the positions the trained model takes, defaults to what
the scaling covers: the positions before any scaling times `factor`. Those positions are the scaling's
`original_max_position_embeddings`, which a run's scaling (linear too) carries: filled in from the starting model
where unset, refused where it names another number. Settings that contradict each other, and a `seq_len` past the
positions, are refused before anything is loaded, naming what to set.
"""
from __future__ import annotations

import dataclasses
import math

from cflib.errors import ParamError
from cflib.model.config import ConfigError, ModelConfig, canonical_rope_scaling
from cflib.model.decoder import POSITION_KEYS
from cflib.train.params import TrainParams

LONGER_CONTEXT = "docs/parameters.md#longer-context-rope-scaling"
ORIGINAL = "original_max_position_embeddings"


def run_config(start: ModelConfig, params: TrainParams) -> ModelConfig:
    """`start` (the config the run starts from) with the run's positions, and seq_len checked against them;
    ParamError naming the parameter otherwise."""
    scaling = run_scaling(start, params.rope_scaling)
    theta = start.rope_theta if params.rope_theta is None else params.rope_theta
    positions = _positions(start, scaling, params)
    try:
        config = dataclasses.replace(start, rope_scaling=scaling, rope_theta=theta, max_position_embeddings=positions)
    except ConfigError as err:
        raise ParamError(str(err)) from None
    if changed(start, config) and not params.full_parameter:
        raise ParamError(f"{', '.join(changed(start, config))} would change the positions of the frozen base, which "
                         "LoRA adapters cannot carry (PEFT loads their base with its own config.json): extend the "
                         "context in a full-parameter run first, then train adapters on its checkpoint")
    check_seq_len(config, start, params.seq_len)
    return config


def changed(start: ModelConfig, config: ModelConfig) -> list[str]:
    """The position keys (cflib.model.decoder.POSITION_KEYS) `config` sets otherwise than `start`."""
    return [key for key in POSITION_KEYS if getattr(config, key) != getattr(start, key)]


def run_scaling(start: ModelConfig, scaling: dict | None) -> dict | None:
    """The scaling a run of rope_scaling `scaling` trains on `start`: the start's own where the run names none, or
    names it again; else the run's, on the positions `start` took before any scaling (its
    original_max_position_embeddings, filled in where unset). ParamError where it names other positions; a start
    whose linear scaling names none (read as max_position_embeddings / factor) takes the run's word for them."""
    if scaling is None:
        return start.rope_scaling
    before = unscaled_positions(start)
    if ORIGINAL in scaling and scaling[ORIGINAL] != before and not guessed(start):
        raise ParamError(f"rope_scaling.{ORIGINAL} {scaling[ORIGINAL]:,} is not the {before:,} positions the starting "
                         f"model took before any RoPE scaling ({_before_from(start)}): leave it unset, which fills in "
                         f"{before}, or set {before}; a scaling is set on the model's unscaled positions, never "
                         f"compounded ({LONGER_CONTEXT})")
    scaling = _with_original(scaling, before)
    own = None if start.rope_scaling is None else _with_original(start.rope_scaling, before)
    return start.rope_scaling if scaling == own else scaling


def _with_original(scaling: dict, before: int) -> dict:
    """`scaling` naming the positions before it: its own, else `before`."""
    try:
        return canonical_rope_scaling({ORIGINAL: before, **scaling})
    except ConfigError as err:
        raise ParamError(str(err)) from None


def unscaled_positions(config: ModelConfig) -> int:
    """The positions `config`'s model took before any RoPE scaling: its scaling's original_max_position_embeddings,
    or for a linear one that names none its positions over factor (as a run extended them before runs named them:
    `guessed`), or its own positions unscaled."""
    scaling = config.rope_scaling
    if scaling is None:
        return config.max_position_embeddings
    if ORIGINAL in scaling:
        return scaling[ORIGINAL]
    return round(config.max_position_embeddings / scaling["factor"])


def guessed(config: ModelConfig) -> bool:
    """Whether unscaled_positions reads `config`'s positions before its scaling as max_position_embeddings / factor,
    its linear scaling naming none (a checkpoint from elsewhere may keep max_position_embeddings at them)."""
    return config.rope_scaling is not None and ORIGINAL not in config.rope_scaling


def _before_from(config: ModelConfig) -> str:
    """Where unscaled_positions read `config`'s positions before scaling, as messages name it."""
    if config.rope_scaling is None:
        return "its max_position_embeddings"
    if not guessed(config):
        return f"its rope_scaling's {ORIGINAL}"
    return (f"read as its max_position_embeddings / factor, its rope_scaling naming no {ORIGINAL}: if it took "
            f"another number, name it as rope_scaling's {ORIGINAL}")


def covered(start: ModelConfig, scaling: dict) -> int:
    """The positions `scaling` covers on the model of `start`: its positions before scaling times factor."""
    before = scaling.get(ORIGINAL, unscaled_positions(start))
    return math.floor(before * scaling["factor"])


def _positions(start: ModelConfig, scaling: dict | None, params: TrainParams) -> int:
    """max_position_embeddings: the run's, or unset the starting model's (with a scaling the run sets, the positions
    it covers). A scaling in force, the run's or the start's, bounds it at what it covers; plain RoPE at the start's
    positions, unless the run raises rope_theta (an extension without a factor that says how far it reaches)."""
    asked = params.max_position_embeddings
    sets_scaling = scaling is not None and scaling != start.rope_scaling
    if asked is None:
        return covered(start, scaling) if sets_scaling else start.max_position_embeddings
    if scaling is not None and asked > covered(start, scaling):
        how = ("raise rope_scaling's factor" if sets_scaling else
               f"set a rope_scaling of a larger factor (the starting model's: {_shown(scaling)})")
        raise ParamError(f"max_position_embeddings {asked:,} is more than the {covered(start, scaling):,} positions "
                         f"rope_scaling covers ({_covering(start, scaling)}): {how}, or leave "
                         f"max_position_embeddings unset")
    if scaling is not None or asked <= start.max_position_embeddings:
        return asked
    extend = (f"extend its context with rope_scaling (e.g. rope_scaling: {{rope_type: linear, factor: "
              f"{_factor(asked, start.max_position_embeddings)}}}, which covers them), or raise rope_theta beside "
              f"max_position_embeddings, as Code Llama's 10^6 did ({LONGER_CONTEXT})")
    if params.rope_theta is None:
        raise ParamError(f"max_position_embeddings {asked:,} is more than the starting model's "
                         f"{start.max_position_embeddings:,} positions, past which its plain RoPE turns through "
                         f"angles it never trained on: {extend}")
    if params.rope_theta <= start.rope_theta:
        raise ParamError(f"rope_theta {params.rope_theta:g} does not raise the starting model's {start.rope_theta:g}, "
                         f"yet max_position_embeddings {asked:,} is more than its {start.max_position_embeddings:,} "
                         f"positions: {extend}")
    return asked


def _shown(scaling: dict) -> str:
    return "{" + ", ".join(f"{key}: {value:g}" if isinstance(value, float) else f"{key}: {value}"
                           for key, value in scaling.items()) + "}"


def _covering(start: ModelConfig, scaling: dict) -> str:
    before = scaling.get(ORIGINAL, unscaled_positions(start))
    guess = f"; {_before_from(start)}" if guessed(start) and before == unscaled_positions(start) else ""
    return f"{before:,} positions before scaling x factor {scaling['factor']:g}{guess}"


def check_seq_len(config: ModelConfig, start: ModelConfig, seq_len: int) -> None:
    """seq_len against the positions of the model the run trains, before anything is written; past them, what to
    set to train that long."""
    limit = config.max_position_embeddings
    if seq_len <= limit:
        return
    if config.rope_scaling is not None and seq_len <= (reach := covered(start, config.rope_scaling)):
        raise ParamError(f"seq_len {seq_len:,} exceeds the model's max_position_embeddings {limit:,}: its rope_scaling "
                         f"covers {reach:,} positions ({_covering(start, config.rope_scaling)}): set "
                         f"max_position_embeddings: {reach}"
                         + (", or leave it unset" if config.rope_scaling != start.rope_scaling else ""))
    if config.rope_scaling is not None and config.rope_scaling != start.rope_scaling:
        raise ParamError(f"seq_len {seq_len:,} exceeds the {limit:,} positions of the model this run trains "
                         f"(max_position_embeddings; rope_scaling covers {_covering(start, config.rope_scaling)}): "
                         f"raise rope_scaling's factor to {_factor(seq_len, unscaled_positions(config))} or more")
    factor = _factor(seq_len, unscaled_positions(config))
    raise ParamError(f"seq_len {seq_len:,} exceeds the model's max_position_embeddings {limit:,}: to train on longer "
                     f"sequences, extend its context with rope_scaling, e.g. rope_scaling: {{rope_type: linear, "
                     f"factor: {factor}}} ({unscaled_positions(config) * factor:,} positions), or yarn "
                     f"({LONGER_CONTEXT})")


def _factor(seq_len: int, before: int) -> int:
    """The smallest whole factor that covers seq_len."""
    return math.ceil(seq_len / before)


def describe(config: ModelConfig) -> str | None:
    """A scaled model's positions and RoPE, as a run's description prints them; None for plain RoPE."""
    scaling = config.rope_scaling
    if scaling is None:
        return None
    return (f"{config.max_position_embeddings:,} positions, rope_scaling "
            + ", ".join(f"{key} {value}" for key, value in scaling.items()) + f", rope_theta {config.rope_theta:g}")
