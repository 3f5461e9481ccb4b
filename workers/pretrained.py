"""The model a role is declared on: a local directory, or a Hugging Face hub id through the hub cache.

``Actor.from_pretrained("meta-llama/Llama-2-7b-hf")`` (and the other roles)
resolve the name here, once, where the role is declared, so a RoleSpec
always holds a local directory: workers never talk to the hub.

A hub id is looked up in the local hub cache first (``HF_HUB_CACHE``, or
``HF_HOME/hub``), then, unless offline (``HF_HUB_OFFLINE=1``), downloaded
into it: only what the engines read (config, tokenizer, safetensors weights).
``builtin:<name>`` models pass through unchanged: the controller makes them
(``controller.models.builtin.resolve_model_path``).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

__all__ = [
    "HUB_ALLOW_PATTERNS",
    "HUB_IGNORE_PATTERNS",
    "export_hint",
    "hub_cache_dir",
    "hub_offline",
    "is_hub_id",
    "missing_directory_error",
    "resolve_pretrained",
]

# What the engines and the tokenizer read: config / generation / tokenizer JSON, safetensors weights,
# sentencepiece / tiktoken vocabularies, vocab / merges text, chat templates. Not *.bin, *.pt, *.gguf,
# *.onnx, *.msgpack, *.h5: other formats of the same weights, often as large as all of the above.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
# Sub-folders (e.g. Llama 3's original/) and Mistral's consolidated.safetensors: copies of the weights
# in layouts transformers does not load, as large again. (The patterns' * also matches "/".)
HUB_IGNORE_PATTERNS = ["*/*", "consolidated*"]

_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean environment variable


def export_hint(path: str) -> str:
    """The hint added when a missing path names a run's HF export (``RUN_DIR/hf_actor``)."""
    if Path(path).name != "hf_actor":
        return ""
    return ("; it names a run's HF export: run that job first (RUN_DIR/hf_actor, e.g. `hybridflow sft "
            "--config examples/sft_tiny.yaml` writes runs/sft_tiny/hf_actor)")


def missing_directory_error(path: str, alternatives: str = "a Hugging Face hub id, 'name' or 'org/name'"
                            ) -> FileNotFoundError:
    """The error for a model path that is not a directory; ``alternatives``: what else the caller takes."""
    return FileNotFoundError(f"model_path {path} is not a directory (or use {alternatives}){export_hint(path)}")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub repo id (``name`` or ``org/name``) rather than a filesystem path."""
    # Spelled as a path (absolute, ./ ../ ~, Windows separators) or a run's export: a path, never a repo.
    if name.startswith(("/", ".", "~")) or "\\" in name or Path(name).name == "hf_actor":
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)  # at most one "/", [A-Za-z0-9-_.], no "--" or "..", at most 96 characters
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> str:
    """The hub cache, read now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else huggingface_hub's own default.

    huggingface_hub reads the environment once, when it is imported (transformers imports it early), so a
    variable set later (a notebook, a test) would go unseen without reading it here.
    """
    from huggingface_hub import constants

    env = os.environ
    if env.get("HF_HUB_CACHE"):
        path = env["HF_HUB_CACHE"]
    elif env.get("HUGGINGFACE_HUB_CACHE"):  # the older name, still honoured by huggingface_hub
        path = env["HUGGINGFACE_HUB_CACHE"]
    elif env.get("HF_HOME"):
        path = os.path.join(env["HF_HOME"], "hub")
    else:
        path = constants.HF_HUB_CACHE
    return os.path.expandvars(os.path.expanduser(path))


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``), read now from huggingface_hub and the environment."""
    from huggingface_hub import constants

    # Either one saying offline is enough: huggingface_hub itself refuses requests on its import-time
    # value, and a variable set since is the user's wish.
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or env.strip().upper() in _TRUE


def resolve_pretrained(name_or_path: str | os.PathLike, *, revision: str | None = None,
                       missing_ok: bool = False) -> str:
    """A local model directory for ``name_or_path``.

    - an existing directory: returned as it is;
    - ``builtin:<name>``: returned unchanged (the controller makes it);
    - a hub id (``name`` or ``org/name``; ``revision``: a branch, tag or commit, default ``main``): its
      snapshot in the hub cache, downloaded first unless offline.

    Anything else raises FileNotFoundError naming it; with ``missing_ok`` (a role's declaration: the
    directory may appear before the role is built) ``name_or_path`` comes back unchanged instead, with a
    warning where it read as a hub id.
    """
    name = os.fspath(name_or_path)
    if not isinstance(name, str) or not name:
        raise TypeError(f"model path must be a non-empty str or path, not {name_or_path!r}")
    if name.startswith("builtin:") or Path(name).is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to hub ids; {name} is "
                             f"{'a built-in model' if name.startswith('builtin:') else 'a local directory'}")
        return name
    if not is_hub_id(name) or Path(name).exists():  # an existing file is a wrong path, not a repo id
        if missing_ok:
            return name
        raise missing_directory_error(name)
    try:
        return _hub_snapshot(name, revision)
    except FileNotFoundError as exc:
        if not missing_ok:
            raise
        warnings.warn(f"{exc} Kept as given: the role fails when built unless it is a directory by then.",
                      stacklevel=3)  # the caller of from_pretrained
        return name


def _hub_snapshot(repo_id: str, revision: str | None) -> str:
    """The cached snapshot of ``repo_id``, downloading it first when it is not cached and we are online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache_dir, offline = hub_cache_dir(), hub_offline()
    patterns = dict(allow_patterns=HUB_ALLOW_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS)
    where = f"{repo_id!r} (revision {revision or 'main'})"
    problem = None
    # The cache first: no request at all, so a cached model resolves offline and without a hub round trip.
    # (It does not look for a newer commit of a branch: download it again to update it.)
    try:
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                     **patterns)
    except LocalEntryNotFoundError:  # not cached, or cached incompletely (also a LocalEntryNotFoundError)
        snapshot = None
    if snapshot is not None:
        missing = _missing_files(Path(snapshot))
        if not missing:
            return snapshot
        # e.g. only config.json, cached by an AutoConfig.from_pretrained call
        problem = f"its cached snapshot {snapshot} lacks {', '.join(missing)}"
    if not offline:
        try:
            snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, **patterns)
        except Exception as exc:  # no network, unknown or gated repo, bad revision: all end the same way
            problem = f"the download failed: {type(exc).__name__}: {exc}"
            raise FileNotFoundError(_not_found(where, cache_dir, offline, problem)) from exc
        missing = _missing_files(Path(snapshot))
        if missing:
            raise FileNotFoundError(f"hub model {where} downloaded to {snapshot} lacks {', '.join(missing)}: "
                                    f"this framework loads config.json and safetensors weights "
                                    f"(model.safetensors or model.safetensors.index.json and its shards)")
        return snapshot
    raise FileNotFoundError(_not_found(where, cache_dir, offline, problem))


def _not_found(where: str, cache_dir: str, offline: bool, problem: str | None) -> str:
    state = "HF_HUB_OFFLINE=1, so no download was tried" if offline else "HF_HUB_OFFLINE=0"
    return (f"model {where} is not a local directory nor a complete snapshot in the Hugging Face hub cache "
            f"{cache_dir} ({state}{'; ' + problem if problem else ''}). Download it once with network access "
            f"(HF_HUB_OFFLINE unset, into this cache: HF_HOME / HF_HUB_CACHE choose it), or give a local "
            f"model directory.")


def _missing_files(snapshot: Path) -> list[str]:
    """What a snapshot lacks of config.json and safetensors weights (the engines load no other format)."""
    missing = [] if (snapshot / "config.json").is_file() else ["config.json"]
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError):
            return [*missing, f"a readable {index.name} (with a weight_map)"]
        missing += [shard for shard in shards if not (snapshot / shard).is_file()]
    elif not (snapshot / "model.safetensors").is_file():
        missing.append("model.safetensors (or model.safetensors.index.json)")
    return missing
