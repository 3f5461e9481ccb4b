"""Hugging Face hub ids in ``from_pretrained`` (workers.pretrained), against a hub cache the tests write.

No hub is reachable here: each test lays out huggingface_hub's real cache
(``models--org--name/{blobs,snapshots/<commit>,refs/main}``) in tmp_path with
the tiny built-in model's files, and points HF_HOME / HF_HUB_CACHE at it.
The download path is exercised with a stand-in ``snapshot_download``.
"""

import hashlib
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError

from workers.pretrained import HUB_ALLOW_PATTERNS, resolve_pretrained

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from controller.models.builtin import resolve_model_path

    return Path(resolve_model_path("builtin:tiny-arithmetic", tmp_path_factory.mktemp("model")))


def cache_model(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, only: tuple[str, ...] = ()) -> Path:
    """``source``'s files as the hub cache holds them: content-named blobs, a snapshot of links, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(source.iterdir()):
        if only and file.name not in only:
            continue
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache, offline; both the environment and huggingface_hub's import-time constants."""
    home = tmp_path / "hf"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def online(monkeypatch):
    """Offline mode off (no request is made: the tests using it replace snapshot_download)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def same(a, b) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def test_a_cached_hub_id_resolves_to_its_snapshot_and_roles_hold_that_directory(hub_cache, tiny_model):
    from controller.models.builtin import resolve_model_path
    from workers.actor import Actor, ReferencePolicy
    from workers.critic import Critic
    from workers.rollout import Rollout

    snapshot = cache_model(hub_cache, "org/name", tiny_model)
    path = resolve_pretrained("org/name")
    assert same(path, snapshot) and (Path(path) / "config.json").is_file()
    assert same(resolve_pretrained("org/name", revision=COMMIT), snapshot)  # a commit: snapshots/<commit>
    assert same(resolve_model_path("org/name", hub_cache / "unused"), snapshot)
    for role in (Actor, ReferencePolicy, Critic, Rollout):
        assert same(role.from_pretrained("org/name").model_path, snapshot), role
    spec = Actor.from_pretrained("org/name", tensor_parallel=2)
    assert spec.kwargs["engine"].tensor_parallel == 2  # the other arguments as before

    canonical = cache_model(hub_cache, "tinyname", tiny_model)  # an id without an org (like "gpt2")
    assert same(resolve_pretrained("tinyname"), canonical)


def test_a_missing_hub_id_offline_names_the_id_the_cache_and_the_offline_switch(hub_cache):
    with pytest.raises(FileNotFoundError) as err:
        resolve_pretrained("org/missing")
    message = str(err.value)
    assert "'org/missing'" in message and str(hub_cache) in message, message
    assert "HF_HUB_OFFLINE=1" in message and "network access" in message and "local model directory" in message

    # A declaration keeps a name it cannot find (the directory may exist by the time the role is built),
    # saying why, rather than failing there.
    from workers.actor import Actor

    with pytest.warns(UserWarning, match="org/missing"):
        assert Actor.from_pretrained("org/missing").model_path == "org/missing"


def test_an_incomplete_cached_snapshot_is_refused_offline(hub_cache, tiny_model):
    # What AutoConfig.from_pretrained leaves in the cache: config.json only, no weights.
    snapshot = cache_model(hub_cache, "org/config-only", tiny_model, only=("config.json",))
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors") as err:
        resolve_pretrained("org/config-only")
    assert str(snapshot) in str(err.value) and "HF_HUB_OFFLINE=1" in str(err.value)


def test_the_cache_and_offline_mode_are_read_at_call_time(hub_cache, tiny_model, tmp_path, monkeypatch):
    # huggingface_hub's constants still name another cache and say online; the environment, set later, wins.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []
    real = huggingface_hub.snapshot_download

    def recording(repo_id, **kwargs):
        calls.append(kwargs)
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE=1"):
        resolve_pretrained("org/later")
    assert [c["local_files_only"] for c in calls] == [True]  # offline: no download tried
    assert all(c["cache_dir"] == str(hub_cache) for c in calls)
    snapshot = cache_model(hub_cache, "org/later", tiny_model)
    assert same(resolve_pretrained("org/later"), snapshot)


def test_online_an_uncached_id_is_downloaded_with_only_the_files_the_engines_read(
        hub_cache, online, tiny_model, monkeypatch):
    calls = []

    def fake_download(repo_id, *, revision=None, cache_dir=None, local_files_only=False, **kwargs):
        calls.append(dict(repo_id=repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                          **kwargs))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return str(cache_model(Path(cache_dir), repo_id, tiny_model))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    path = resolve_pretrained("org/fresh", revision="v1")
    assert same(path, hub_cache / "models--org--fresh" / "snapshots" / COMMIT)
    assert [c["local_files_only"] for c in calls] == [True, False]  # the cache first
    download = calls[1]
    assert download["repo_id"] == "org/fresh" and download["revision"] == "v1" and download["cache_dir"] == str(hub_cache)
    assert download["allow_patterns"] == HUB_ALLOW_PATTERNS
    assert {"*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"} <= set(download["allow_patterns"])
    assert not any(p.endswith((".bin", ".pt", ".gguf")) for p in download["allow_patterns"])
    assert set(download["ignore_patterns"]) == {"*/*", "consolidated*"}  # weight copies in other layouts


def test_online_a_failed_download_names_the_cause(hub_cache, online, monkeypatch):
    def unreachable(repo_id, *, local_files_only=False, **kwargs):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(FileNotFoundError) as err:
        resolve_pretrained("org/far")
    message = str(err.value)
    assert "'org/far'" in message and str(hub_cache) in message and "HF_HUB_OFFLINE=0" in message
    assert "ConnectionError: Name or service not known" in message, message


def test_local_directories_and_builtins_pass_through_and_missing_paths_are_named(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / "my-model"
    local.mkdir()
    assert resolve_pretrained(str(local)) == str(local)
    assert resolve_pretrained(local) == str(local)  # a Path: its str
    assert resolve_pretrained("builtin:tiny-arithmetic") == "builtin:tiny-arithmetic"
    monkeypatch.chdir(tmp_path)
    assert resolve_pretrained("my-model") == "my-model"  # a directory wins over the hub id of that name
    with pytest.raises(ValueError, match="revision='v1' applies to hub ids"):
        resolve_pretrained(str(local), revision="v1")

    for path in ("./missing/dir", "/abs/path", "a/b/c", "../up"):
        with pytest.raises(FileNotFoundError, match=f"model_path {path} is not a directory"):
            resolve_pretrained(path)
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="model_path weights.safetensors is not a directory"):
        resolve_pretrained("weights.safetensors")  # a file, though it reads as a repo id
    for export in (str(tmp_path / "sft" / "hf_actor"), "runs/hf_actor"):  # a run's export, never a repo id
        with pytest.raises(FileNotFoundError, match="run that job first") as err:
            resolve_pretrained(export)
        assert f"model_path {export} is not a directory" in str(err.value)


def test_resolve_model_path_keeps_builtins_directories_and_its_messages(hub_cache, tiny_model, tmp_path):
    from controller.models.builtin import BUILTIN_MODELS, BUILTIN_REWARD_MODELS, PACKAGED_MODELS, resolve_model_path

    assert resolve_model_path(str(tiny_model), tmp_path) == str(tiny_model)
    made = resolve_model_path("builtin:tiny-arithmetic", tmp_path / "work")
    assert made == str(tmp_path / "work" / "builtin-tiny-arithmetic") and (Path(made) / "config.json").is_file()
    with pytest.raises(ValueError, match="unknown built-in model 'builtin:nope'"):
        resolve_model_path("builtin:nope", tmp_path)

    known = ["builtin:" + k for k in (*BUILTIN_MODELS, *BUILTIN_REWARD_MODELS, *PACKAGED_MODELS)]
    missing = tmp_path / "sft" / "hf_actor"
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path(str(missing), tmp_path)
    assert str(err.value) == (  # word for word, as before hub ids
        f"model_path {missing} is not a directory (or use one of {known}); it names a run's HF export: run that "
        f"job first (RUN_DIR/hf_actor, e.g. `hybridflow sft --config examples/sft_tiny.yaml` writes "
        f"runs/sft_tiny/hf_actor)")
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path("/abs/path", tmp_path)
    assert str(err.value) == f"model_path /abs/path is not a directory (or use one of {known})"
    with pytest.raises(FileNotFoundError) as err:  # a hub id: the hub's message, and the built-ins
        resolve_model_path("org/missing", tmp_path)
    assert "'org/missing'" in str(err.value) and str(hub_cache) in str(err.value) and str(known) in str(err.value)
