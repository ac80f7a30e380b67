"""A written bundle (or LoRA adapters) sent to a Hugging Face Hub repository through `huggingface_hub`.

`push_folder(folder, "org/name")` creates the repository when it does not
exist (private when asked; an existing one keeps its visibility), creates the
branch `revision` from main when it does not exist, and uploads the folder
with `HfApi.upload_folder` in one commit. It is resumable as the Hub makes it:
a file whose content the Hub already holds is not sent again (the LFS batch
answer, or Xet's deduplication where `hf_xet` is installed), and a file the
repository already has unchanged is left out of the commit, so running the
same push again after an interruption sends only what had not landed. The
endpoint and the token are `huggingface_hub`'s: `HF_ENDPOINT`, and `HF_TOKEN`
or the token `hf auth login` saved.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

# The Hub's repository names: an owner and a name, letters, digits, '-', '_' and '.', at most 96 characters.
# Matched with fullmatch: `$` also matches before a final newline, which would let "org/name\n" through.
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


COMMIT = re.compile(r"[0-9a-f]{40}")  # a Hub commit named in full


class PushError(RuntimeError):
    """A push that did not finish; the message names the repository and what stopped it. What landed stays."""


def repo_id_problem(repo_id: str) -> str | None:
    """What is wrong with a Hub repository name, or None."""
    if not REPO_ID.fullmatch(repo_id) or ".." in repo_id or repo_id.endswith((".git", ".")):
        return f"{repo_id!r} is not a Hub repository name (ORG/NAME: letters, digits, '-', '_', '.')"
    return None


def names_hub_commit(record: object, repo_id: str | None = None) -> bool:
    """Whether a recorded Hub start or base is a mapping naming a repository (`repo_id`, where given) and a commit
    in full."""
    return (isinstance(record, dict) and isinstance(record.get("repo_id"), str)
            and not repo_id_problem(record["repo_id"]) and (repo_id is None or record["repo_id"] == repo_id)
            and isinstance(record.get("commit"), str) and COMMIT.fullmatch(record["commit"]) is not None)


def check_push(repo_id: str, what: str = "--push") -> None:
    """PushError before anything is written or sent: a name the Hub cannot hold, or no token to push with."""
    from huggingface_hub import get_token

    if problem := repo_id_problem(repo_id):
        raise PushError(f"{what}: {problem}")
    if get_token() is None:
        raise PushError(f"pushing to {repo_id} needs a Hugging Face token: run `hf auth login`, or set HF_TOKEN")


def first_link(folder: Path) -> Path | None:
    """The first symbolic link under `folder`, nested entries included (in sorted order), or None."""
    for root, folders, files in os.walk(folder):  # links to folders are listed in `folders`, never walked into
        folders.sort()
        for name in sorted(folders + files):
            if (Path(root) / name).is_symlink():
                return Path(root) / name
    return None


def push_folder(folder: str | Path, repo_id: str, private: bool | None = None, revision: str | None = None,
                echo: Callable[[str], None] | None = print) -> str:
    """Upload every file of `folder` to the Hub repository `repo_id` (on branch `revision`, default main) and
    return the commit's URL. `private`: how a repository created here is made (None: the owner's default)."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    check_push(repo_id)
    if not folder.is_dir():
        raise PushError(f"{folder}: no such folder to push to {repo_id}")
    # upload_folder sends a link's target: a file outside the folder would be published under the link's name.
    if (link := first_link(folder)) is not None:
        raise PushError(f"{link}: a symbolic link (to {os.readlink(link)}) in the folder to push to {repo_id}; "
                        "nothing was sent: replace it with the file itself or remove it")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision,
                                   commit_message=f"Upload {folder.name} with cflib")
    except Exception as err:  # HTTP, network and the Hub's own refusals alike: the same way forward
        raise PushError(f"pushing {folder} to {repo_id}{'@' + revision if revision else ''} stopped: {err}. What "
                        "was uploaded stays on the Hub; the same push again sends only the rest") from err
    if echo is not None:
        echo(f"pushed {folder} to {repo_id}{'@' + revision if revision else ''}: {commit.commit_url}")
    return commit.commit_url
