"""cflib.schema: fields declared once, read from papermill strings, YAML values and a notebook's namespace."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from papermill.translators import translate_parameters

from cflib.errors import ParamError
from cflib.schema import Params, coerce, composed, injected_names, parsed_by


def doubled(name: str, value: object) -> int:
    return 2 * coerce(name, value, int)


@dataclass(frozen=True)
class Shape:
    """The first section."""

    width: int = 4
    tags: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Timing:
    """The second section."""

    rate: float = 0.5
    sizes: tuple[int, ...] = (1, 2)
    steps: int = parsed_by(doubled, 2)


@dataclass(frozen=True)
class Job(composed(Shape, Timing)):
    def validate(self) -> None:
        if self.width > 100:
            raise ParamError(f"width must be at most 100, got {self.width}")


def test_sections_compose_flat_in_their_order():
    assert Job.names() == ["width", "tags", "rate", "sizes", "steps"]
    job = Job.from_dict({"width": "8", "rate": "1e-3", "steps": "5"})
    assert (job.width, job.rate, job.steps, job.sizes) == (8, 1e-3, 10, (1, 2))
    with pytest.raises(ParamError, match="width must be at most 100"):
        Job.from_dict({"width": 101})


@pytest.mark.parametrize("raw, expected", [
    ("a,b", ("a", "b")), ("[a, 'b']", ("a", "b")), (["a", "b"], ("a", "b")), ("None", None), ("", None),
])
def test_lists_of_names_from_yaml_and_papermill_strings(raw, expected):
    assert Job.from_dict({"tags": raw}).tags == expected


@pytest.mark.parametrize("raw, expected", [("16,32", (16, 32)), ("[16, 32]", (16, 32)), ([8], (8,)), (4, (4,))])
def test_lists_of_numbers_from_yaml_and_papermill_strings(raw, expected):
    assert Job.from_dict({"sizes": raw}).sizes == expected


@pytest.mark.parametrize("raw, message", [
    ({"tags": [1]}, "tags must be a list of names"), ({"sizes": "1,x"}, "sizes must be an integer"),
    ({"width": None}, "width cannot be None"), ({"rate": "fast"}, "rate must be a number"),
    ({"widht": 3}, "unknown parameter 'widht' (did you mean 'width'?)"),
])
def test_wrong_values_name_the_parameter(raw, message):
    with pytest.raises(ParamError) as caught:
        Job.from_dict(raw)
    assert message in str(caught.value)


def test_the_injected_names_are_those_papermill_writes():
    injected = translate_parameters("python3", "python", {"lrr": 0.1, "tags": ["a"]}, "Parameters")
    namespace = {"In": ["", "width = 3", injected, "# Parameters of my own: a comment\nrate = 1"]}
    assert injected_names(namespace) == ["lrr", "tags"]
    assert injected_names({}) == []


def test_from_namespace_takes_the_declared_names_and_refuses_an_injected_stranger():
    namespace = {"width": 9, "bundle": "hub", "In": ["# Parameters\nwidth = 9\n"]}
    assert Job.from_namespace(namespace) == Job(width=9)
    with pytest.raises(ParamError, match=r"notebook parameters: unknown parameter 'widht' \(did you mean 'width'"):
        Job.from_namespace({**namespace, "widht": 9, "In": ["# Parameters\nwidht = 9\n"]})


def test_a_base_class_without_sections_reads_the_same_way():
    @dataclass(frozen=True)
    class Small(Params):
        out_dir: str | None = None
        verbose: bool = False

    assert Small.from_dict({"out_dir": "null", "verbose": "yes"}) == Small(None, True)
