"""A Hub repository name checked before anything is written or sent: the whole name, to its last character."""
from __future__ import annotations

import pytest

from cflib.export.push import PushError, check_push, repo_id_problem


@pytest.mark.parametrize("repo_id", ["org/name", "cflib-org/tiny", "a/b", "Org_1/model.v2-base"])
def test_a_hub_repository_name_is_accepted(repo_id: str) -> None:
    assert repo_id_problem(repo_id) is None


@pytest.mark.parametrize("repo_id", [
    "org/name\n",  # `$` matches before a final newline: a name read from a file or pasted with its line end
    "org/name\r\n", "org/name ", " org/name", "org/name\n/other", "org\n/name",
    "org/name/", "org", "/name", "org/na..me", "org/name.git", "org/name.", "org/" + "x" * 97,
], ids=repr)
def test_a_name_the_hub_cannot_hold_is_named_with_what_is_wrong(repo_id: str) -> None:
    problem = repo_id_problem(repo_id)
    assert problem is not None and problem.startswith(f"{repo_id!r} is not a Hub repository name")


def test_a_name_with_a_trailing_newline_is_refused_before_the_token_is_looked_for() -> None:
    with pytest.raises(PushError, match=r"^--push: 'org/name\\n' is not a Hub repository name"):
        check_push("org/name\n")
