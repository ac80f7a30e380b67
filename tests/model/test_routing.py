"""Deterministic route tables: shape, determinism, distinct experts, balance."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from cflib.model.routing import build_route_table, modulo_cyclic, token_id_multi_hash

try:
    from tiny_models import tiny_config
except ImportError:  # pragma: no cover - tests/ imported as a package
    from tests.tiny_models import tiny_config

Builder = Callable[[int, int, int], torch.Tensor]
BUILDERS: dict[str, Builder] = {"modulo_cyclic": modulo_cyclic, "token_id_multi_hash": token_id_multi_hash}

# (vocab_size, num_experts): V divisible by E or not, V < E, one expert, the released shape.
SHAPES = [(48, 4), (50, 4), (97, 5), (101, 7), (3, 4), (9, 1), (32000, 4)]
CASES = [(v, e, k) for v, e in SHAPES for k in range(1, e + 1)]


def case_id(case: tuple[int, int, int]) -> str:
    return "V{}-E{}-k{}".format(*case)


@pytest.fixture(params=list(BUILDERS), ids=list(BUILDERS))
def builder(request: pytest.FixtureRequest) -> Builder:
    return BUILDERS[request.param]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_table_is_valid(builder: Builder, case: tuple[int, int, int]) -> None:
    vocab, experts, top_k = case
    table = builder(vocab, experts, top_k)
    assert table.shape == (top_k, vocab)
    assert table.dtype == torch.int64
    assert int(table.min()) >= 0 and int(table.max()) < experts
    # distinct experts per token: sorted along the route axis, no two neighbours are equal
    ordered = table.sort(dim=0).values
    assert bool((ordered[1:] != ordered[:-1]).all()), "a token is routed twice to one expert"
    # balanced primary expert (both builders take it from a permutation of the vocabulary)
    counts = torch.bincount(table[0], minlength=experts)
    assert int(counts.max() - counts.min()) <= 1, counts.tolist()


@pytest.mark.parametrize("case", [(50, 4, 2), (97, 5, 3), (32000, 4, 2)], ids=case_id)
def test_table_is_deterministic_and_ignores_the_global_rng(builder: Builder, case: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    first = builder(*case)
    torch.manual_seed(1)
    torch.rand(10)
    assert torch.equal(first, builder(*case))


def test_modulo_cyclic_values() -> None:
    table = modulo_cyclic(11, 4, 3)
    tokens = torch.arange(11)
    for k in range(3):
        assert torch.equal(table[k], (tokens + k) % 4)


@pytest.mark.parametrize("vocab, experts", [(50, 4), (97, 5)])
def test_modulo_cyclic_balances_every_route(vocab: int, experts: int) -> None:
    for row in modulo_cyclic(vocab, experts, experts):
        counts = torch.bincount(row, minlength=experts)
        assert int(counts.max() - counts.min()) <= 1


def test_hash_is_not_the_modulo_table() -> None:
    # A "hash" that degenerated to t mod E would still pass the balance checks.
    hashed, cyclic = token_id_multi_hash(50, 4, 2), modulo_cyclic(50, 4, 2)
    assert not torch.equal(hashed[0], cyclic[0])
    assert not torch.equal(hashed[1], cyclic[1])


@pytest.mark.parametrize("hash_count", [1, 2, 3])
def test_hash_count_keeps_tables_valid(hash_count: int) -> None:
    table = token_id_multi_hash(97, 5, 4, hash_count)
    ordered = table.sort(dim=0).values
    assert bool((ordered[1:] != ordered[:-1]).all())
    assert torch.equal(table, token_id_multi_hash(97, 5, 4, hash_count))


@pytest.mark.parametrize("strategy", ["modulo_cyclic", "token_id_multi_hash"])
def test_build_route_table_follows_the_config(strategy: str) -> None:
    config = tiny_config(routing_strategy=strategy, num_experts_per_tok=3, route_hash_count=3)
    expected = (modulo_cyclic(50, 4, 3) if strategy == "modulo_cyclic"
                else token_id_multi_hash(50, 4, 3, 3))
    assert torch.equal(build_route_table(config), expected)


def test_a_new_model_needs_a_strategy_cflib_can_build() -> None:
    from cflib.model.config import ConfigError
    from cflib.model.decoder import TRMoEModel
    with pytest.raises(ConfigError, match="routing_strategy 'learned' is not one of"):
        TRMoEModel(tiny_config(routing_strategy="learned"))
