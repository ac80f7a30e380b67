"""A Hub bundle loaded by transformers without running the bundle's own code.

cflib wrote the modules of every bundle it exports (cflib/export/hub_modules),
so it knows them: a bundle is loaded with cflib's own copies of those classes
(registered with transformers' Auto classes, `trust_remote_code=False`), and
no Python file of the bundle runs. A bundle whose modules differ from cflib's
(by SHA-256), that carries Python files cflib did not write, or whose
config.json or tokenizer_config.json maps other classes, is refused, naming
the file, unless the user trusts its author and says `trust_bundle_code`:
only then do its own modules run (transformers' `trust_remote_code=True`).
"""
from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from cflib.export.hub import AUTO_MAP, HUB_MODULES, MODEL_TYPE
from cflib.jsonio import read_json

TOKENIZER_CONFIG = "tokenizer_config.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def own_module_digests() -> dict[str, str]:
    """The SHA-256 of each module cflib copies into a bundle."""
    modules = resources.files("cflib.export.hub_modules")
    return {name: _sha256(modules.joinpath(name).read_bytes()) for name in HUB_MODULES}


def code_differences(bundle: Path) -> list[str]:
    """Where the bundle's code is not cflib's own, one line each; empty for a bundle cflib exported."""
    found, own = [], own_module_digests()
    for name, digest in own.items():
        path = bundle / name
        if path.is_symlink() or not path.is_file():
            found.append(f"{path}: missing (or not a plain file)")
        elif _sha256(path.read_bytes()) != digest:
            found.append(f"{path}: differs from cflib's own module (SHA-256)")
    found += [f"{path}: a Python file cflib's bundles do not have" for path in sorted(bundle.rglob("*.py"))
              if path.relative_to(bundle).as_posix() not in own]
    config = read_json(bundle / "config.json", ValueError, "bundle config")
    if not isinstance(config, dict) or config.get("auto_map", AUTO_MAP) != AUTO_MAP or \
            config.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        found.append(f"{bundle / 'config.json'}: its auto_map or model_type names other classes than cflib's")
    if (bundle / TOKENIZER_CONFIG).is_file():
        tokenizer = read_json(bundle / TOKENIZER_CONFIG, ValueError, "tokenizer config")
        if not isinstance(tokenizer, dict) or "auto_map" in tokenizer:
            found.append(f"{bundle / TOKENIZER_CONFIG}: maps a tokenizer class of its own (auto_map)")
    return found


def check_bundle_code(bundle: str | Path, trust_bundle_code: bool, error: Callable[[str], Exception]) -> bool:
    """Whether transformers may run the bundle's own code (`trust_remote_code`): never for a bundle whose code is
    cflib's (its own classes load it); for one whose code differs, only with `trust_bundle_code`, else `error`
    naming the first difference."""
    try:
        differences = code_differences(Path(bundle))
    except ValueError as err:
        raise error(str(err)) from None
    if not differences:
        register_own_classes()
        return False
    if trust_bundle_code:
        return True
    more = f" (and {len(differences) - 1} more)" if len(differences) > 1 else ""
    raise error(f"{differences[0]}{more}: cflib loads a bundle with its own modeling code and runs none of the "
                "bundle's; export the bundle again (python -m cflib.export hub), or, only if you trust its author, "
                "set trust_bundle_code: true to run its own modules")


def register_own_classes() -> None:
    """cflib's configuration and model classes for model_type tr_hash_moe in transformers' Auto classes, so a
    bundle loads with them and `trust_remote_code=False`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cflib.export.hub_modules.configuration_tr_hash_moe import TRHashConfig
    from cflib.export.hub_modules.modeling_tr_hash_moe import TRHashForCausalLM

    AutoConfig.register(MODEL_TYPE, TRHashConfig, exist_ok=True)
    AutoModelForCausalLM.register(TRHashConfig, TRHashForCausalLM, exist_ok=True)


def load_bundle_model(bundle: str | Path, trust_bundle_code: bool = False,
                      error: Callable[[str], Exception] = ValueError, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(bundle, **kwargs)` with cflib's own classes (check_bundle_code)."""
    from transformers import AutoModelForCausalLM

    trust = check_bundle_code(bundle, trust_bundle_code, error)
    return AutoModelForCausalLM.from_pretrained(str(bundle), trust_remote_code=trust, **kwargs)
