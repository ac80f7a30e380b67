"""A Hub bundle as a run's start: `init_checkpoint: hub:ORG/NAME[@REVISION]`, the counterpart of push.py.

The revision (a branch, a tag or a commit; main by default) is resolved to its
commit once, and the run names that commit from then on (its parameters, its
record, its resume identity): a resume of `hub:ORG/NAME` continues from the
commit its run started from, never from a newer one. Only the files a bundle's
model and tokenizer are read from are downloaded (config.json,
model.safetensors, generation_config.json, the tokenizer files), never a Python
file: cflib trains with its own model code and runs none a repository ships.
They land in the Hugging Face cache (HF_HOME, HF_HUB_CACHE), shared with
transformers and with every other run, a folder per commit, where a later run or
resume at that commit finds them without the network. config.json is read first
and must be a TR-MoE bundle's (model_type tr_hash_moe, no classes of its own in
auto_map); every file's size is bounded before its bytes are fetched (by the
Hub's listing) and again before they are read (on disk): the weights by what the
config's tensors take. The endpoint and the token are huggingface_hub's:
HF_ENDPOINT, and HF_TOKEN or the token `hf auth login` saved; with
HF_HUB_OFFLINE=1 only the cache is read, which a commit named in full (or the
one a resumed run recorded, named as the run named it) can use.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from cflib.data.sources import HUB  # the prefix a data source on the Hub has too
from cflib.errors import shown
from cflib.export.hub import AUTO_MAP, MODEL_TYPE
from cflib.export.peft import ADAPTER_CONFIG_FILE
from cflib.export.push import COMMIT, repo_id_problem
from cflib.export.tokenizer_files import CONFIG_FILE as TOKENIZER_CONFIG_FILE
from cflib.export.tokenizer_files import COMPANIONS, TOKENIZER_BYTES, TOKENIZER_FILE
from cflib.jsonio import MAX_BYTES, read_json
from cflib.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, CheckpointError
from cflib.model.config import ConfigError, ModelConfig
from cflib.paths import resolve_path

# What a bundle's model and tokenizer are read from, with the most bytes cflib reads of each; nothing else of the
# repository is downloaded (its Python modules above all). The weights' bound comes from the config (weights_bound).
BUNDLE_FILES = {CONFIG_FILE: MAX_BYTES, "generation_config.json": MAX_BYTES, TOKENIZER_FILE: TOKENIZER_BYTES,
                **{name: MAX_BYTES for name in COMPANIONS}}
HUB_TIMEOUT_S = 10  # as a hub: data source waits for the Hub (cflib.data.sources)
T = TypeVar("T")


@dataclass(frozen=True)
class HubStart:
    """A Hub bundle at the commit a run trains from."""

    repo_id: str
    revision: str | None  # as the spec named it (None: the default branch)
    commit: str

    @property
    def spec(self) -> str:
        """The init_checkpoint that names this commit whatever the branch does next."""
        return pinned_spec(self.record())

    def record(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}


def pinned_spec(start: dict) -> str:
    """hub:ORG/NAME@COMMIT of a Hub start as recorded (HubStart.record()): the commit, whatever the branch does."""
    return f"{HUB}{start['repo_id']}@{start['commit']}"


def is_hub(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(HUB)


def hub_parts(spec: str) -> tuple[str, str | None]:
    """(repository, revision or None) of hub:ORG/NAME[@REVISION]; CheckpointError for a malformed one."""
    repo_id, at, revision = spec[len(HUB):].partition("@")
    problem = repo_id_problem(repo_id)
    if problem or (at and not revision) or "\n" in revision or len(revision) > 255:
        raise CheckpointError(f"{spec}: a Hub model is hub:ORG/NAME[@REVISION] (a branch, tag or commit), e.g. "
                              f"hub:my-org/my-model@main{': ' + problem if problem else ''}")
    return repo_id, revision or None


def resolve_start(spec: str, recorded: str | None = None, recorded_start: object = None) -> HubStart:
    """The commit `spec` names. `recorded`: the pinned spec a resumed run's checkpoint records, `recorded_start`
    its HubStart.record() (the revision the run named); a spec naming that repository with no revision, with the
    revision the run named (the same string: a branch or tag, whatever it points at now), or with that commit,
    resolves to it without asking the Hub (the run goes on from the commit it started from, whatever the branch
    did since, offline too; another revision is resolved and compared as a change of model). A commit named in
    full is taken as it is (fetch_bundle finds whether the Hub has it); any other revision is resolved by the Hub,
    now."""
    repo_id, revision = hub_parts(spec)
    if is_hub(recorded):
        then, commit = hub_parts(recorded)
        start = recorded_start if isinstance(recorded_start, dict) and recorded_start.get("commit") == commit \
            else {}
        named = start.get("revision") if isinstance(start.get("revision"), str) else None
        if then == repo_id and commit is not None and revision in (None, commit, named):
            return HubStart(repo_id, named if start else revision, commit)  # the run's start, as it named it
    if revision is not None and COMMIT.fullmatch(revision):
        return HubStart(repo_id, revision, revision)
    from huggingface_hub import HfApi

    info = _hub_call(spec, lambda: HfApi().model_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S))
    return HubStart(repo_id, revision, info.sha)


def checkpoint_folder(spec: str) -> Path:
    """The folder an init_checkpoint names: a Hub bundle's in the Hugging Face cache (fetch_bundle), else the path
    (relative to the project root)."""
    return fetch_bundle(spec) if is_hub(spec) else resolve_path(spec)


def fetch_bundle(spec: str, weights: bool = True) -> Path:
    """The snapshot folder of the Hub bundle `spec` names, at its commit, in the Hugging Face cache: taken from the
    cache where it is there whole, else downloaded (what is missing of it), and checked before anything reads it.
    weights: False fetches config.json alone (the architecture, for the batch arithmetic)."""
    start = resolve_start(spec)
    folder = _cached(start, weights) or _download(start, weights)
    if weights and not (folder / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{start.spec}: {folder / WEIGHTS_FILE}: missing from the Hugging Face cache")
    limits = {**BUNDLE_FILES, WEIGHTS_FILE: weights_bound(bundle_config(folder, start.spec))}
    for name, limit in limits.items():  # as they landed, before anything reads them
        if (folder / name).is_file() and (folder / name).stat().st_size > limit:
            raise CheckpointError(f"{start.spec}: {folder / name}: larger than the {limit:,} bytes cflib reads of "
                                  "it" + (" for the model its config.json describes" if name == WEIGHTS_FILE else ""))
    return folder


def bundle_config(folder: Path, spec: str) -> ModelConfig:
    """The model config of a Hub bundle's config.json (read bounded): a TR-MoE bundle's, whose auto_map, if any,
    names cflib's own classes, and whose tokenizer config (where it is there) maps no class of its own;
    CheckpointError naming `spec` otherwise."""
    tokenizer_config = folder / TOKENIZER_CONFIG_FILE
    if tokenizer_config.is_file():
        document = read_json(tokenizer_config, CheckpointError, "tokenizer config")
        if not isinstance(document, dict):
            raise CheckpointError(f"{spec}: its {TOKENIZER_CONFIG_FILE} is no JSON object")
        if "auto_map" in document:
            raise CheckpointError(f"{spec}: its {TOKENIZER_CONFIG_FILE} maps a tokenizer class of its own "
                                  f"(auto_map {shown(document['auto_map'])}): cflib runs no code a repository ships")
    raw = read_json(folder / CONFIG_FILE, CheckpointError, "model config (config.json)")
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type != MODEL_TYPE:
        named = f"model_type {shown(model_type)}" if model_type is not None else "no model_type"
        raise CheckpointError(f"{spec}: not a cflib/TR-MoE bundle: its config.json names {named}, not "
                              f"{MODEL_TYPE!r} (python -m cflib.export hub writes such a bundle)")
    if raw.get("auto_map", AUTO_MAP) != AUTO_MAP:
        raise CheckpointError(f"{spec}: its config.json maps classes of its own (auto_map "
                              f"{shown(raw['auto_map'])}), not cflib's: a bundle cflib exported names cflib's, and "
                              "cflib runs no code a repository ships")
    try:
        return ModelConfig.from_dict(raw, source=f"{spec}: config.json")
    except ConfigError as err:
        raise CheckpointError(str(err)) from None


def weights_bound(config: ModelConfig) -> int:
    """The most bytes a model.safetensors of `config` takes, from the config's sizes alone (no skeleton: a config
    of millions of layers costs nothing here): every weight at 8 bytes (float32 takes 4), the int64 route tables,
    each layer's derived buffers (a byte a token, a few expert pairs, inv_freq), and a header of a KiB a tensor."""
    d, vocab, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    weights = config.num_parameters() + (0 if config.tie_word_embeddings else vocab * d)
    routes = layers * config.num_experts_per_tok * vocab
    derived = layers * (vocab + 4 * config.head_dim + 256)
    return 8 * (weights + routes) + derived + 1024 * (20 * layers + 8) + 2**16


def _cached(start: HubStart, weights: bool) -> Path | None:
    """The commit's snapshot folder where the cache holds what is asked, without the network; else None."""
    from huggingface_hub import snapshot_download

    wanted = [CONFIG_FILE, WEIGHTS_FILE] if weights else [CONFIG_FILE]
    try:
        folder = Path(snapshot_download(start.repo_id, revision=start.commit, local_files_only=True,
                                        allow_patterns=[*BUNDLE_FILES, WEIGHTS_FILE] if weights else [CONFIG_FILE]))
    except Exception:  # not in the cache, or not whole (huggingface_hub's errors differ between versions)
        return None
    return folder if all((folder / name).is_file() for name in wanted) else None


def _download(start: HubStart, weights: bool) -> Path:
    """The commit's bundle files downloaded into the cache: its listing checked first (a bundle's config and
    weights, each file within its bound), then its config files fetched and checked (bundle_config), then the
    rest, the weights only when the config allows their size."""
    from huggingface_hub import HfApi, snapshot_download

    info = _hub_call(start.spec, lambda: HfApi().model_info(start.repo_id, revision=start.commit,
                                                            files_metadata=True, timeout=HUB_TIMEOUT_S))
    sizes = {sibling.rfilename: sibling.size for sibling in info.siblings or []}
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if name not in sizes]
    if missing:
        held = (" (it holds LoRA adapters: start from their base, with full_parameter: false for adapters of your "
                "own)" if ADAPTER_CONFIG_FILE in sizes else "")
        raise CheckpointError(f"{start.spec}: not a cflib/TR-MoE bundle: the repository has no "
                              f"{' and no '.join(missing)}{held}; python -m cflib.export hub writes one")
    for name, limit in BUNDLE_FILES.items():
        if (sizes.get(name) or 0) > limit:
            raise CheckpointError(f"{start.spec}: {name} is {sizes[name]:,} bytes, more than the {limit:,} cflib "
                                  "reads of it; nothing was downloaded")

    def fetch(names: list[str]) -> Path:
        return Path(_hub_call(start.spec, lambda: snapshot_download(start.repo_id, revision=start.commit,
                                                                    allow_patterns=names)))

    folder = fetch([CONFIG_FILE] if not weights else [name for name in (CONFIG_FILE, TOKENIZER_CONFIG_FILE)
                                                       if name in sizes])
    if not weights:
        return folder
    limit = weights_bound(bundle_config(folder, start.spec))  # refused here, nothing large was downloaded
    if (sizes[WEIGHTS_FILE] or 0) > limit:
        raise CheckpointError(f"{start.spec}: {WEIGHTS_FILE} is {sizes[WEIGHTS_FILE]:,} bytes, more than the "
                              f"{limit:,} the model its config.json describes can take; the weights were not "
                              "downloaded")
    return fetch([name for name in (*BUNDLE_FILES, WEIGHTS_FILE) if name in sizes])


def _hub_call(spec: str, call: Callable[[], T]) -> T:
    """`call`'s answer from the Hub, or CheckpointError naming `spec` and what to do."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    repo_id, revision = hub_parts(spec)
    try:
        return call()
    except RevisionNotFoundError:
        raise CheckpointError(f"{spec}: {repo_id} has no revision {revision or 'main'!r} on the Hugging Face Hub "
                              "(a branch, a tag or a commit)") from None
    except RepositoryNotFoundError:  # also a gated one this token may not read
        raise CheckpointError(f"{spec}: no model repository {repo_id} on the Hugging Face Hub that this token may "
                              "read (a private or gated one needs HF_TOKEN, or `hf auth login`)") from None
    except Exception as err:  # no network, offline mode, the Hub's other refusals
        first = str(err).splitlines()[0] if str(err) else ""
        raise CheckpointError(f"{spec}: could not read it from the Hugging Face Hub ({type(err).__name__}: "
                              f"{first}); a hub: start needs network access, {_cache_hint(repo_id)}"
                              ) from None


def _cache_hint(repo_id: str) -> str:
    """How to start offline: from a commit named in full, which the Hugging Face cache holds whole (the newest few
    it holds are named)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    snapshots = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots"
    held = sorted((folder for folder in (snapshots.iterdir() if snapshots.is_dir() else ())
                   if COMMIT.fullmatch(folder.name) and all((folder / name).is_file()
                                                            for name in (CONFIG_FILE, WEIGHTS_FILE))),
                  key=lambda folder: folder.stat().st_mtime, reverse=True)
    if not held:
        return "or, offline, a commit named in full that the Hugging Face cache holds (it holds none of this one)"
    named = ", ".join(f"hub:{repo_id}@{folder.name}" for folder in held[:3])
    return f"or, offline, a commit named in full that the Hugging Face cache holds: {named}" + (
        " (newest first)" if held[1:] else "")
