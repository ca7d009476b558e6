"""Hugging Face model ids resolve through huggingface_hub's cache, laid out here by hand
(``models--owner--name/{refs,snapshots}``) under a fresh ``HF_HOME``, offline: no test
reaches the Hub. huggingface_hub reads its environment when imported, so the cases that
set it run in a child process."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenspeed.models.hub import is_repo_id, resolve_model

from hf_models import checkpoint

COMMITS = {"main": "a" * 40, "v1": "b" * 40}
CHILD = """
import json, sys, torch
import tokenspeed as ts
from tokenspeed.models.hub import ModelNotFoundError, resolve_model

def error(*args, **kwargs):
    try:
        resolve_model(*args, **kwargs)
    except ModelNotFoundError as exc:
        return str(exc)

by_id, by_dir = ts.models.load("acme/tiny-llama"), ts.models.load(sys.argv[1])
greedy = ts.SamplingParams(temperature=0, max_tokens=4)
tokens = [ts.LLM(model, revision=revision, max_model_len=64).generate([[1, 2, 3]], greedy, use_tqdm=False)[0].token_ids
          for model, revision in (("acme/tiny-llama", "v1"), (sys.argv[1], None))]
print(json.dumps({
    "main": str(resolve_model("acme/tiny-llama")),
    "v1": str(resolve_model("acme/tiny-llama", revision="v1")),
    "same_weights": all(torch.equal(a, b) for a, b in zip(by_id.state_dict().values(),
                                                          by_dir.state_dict().values())),
    "llm_same_tokens": tokens[0] == tokens[1],
    "not_cached": error("acme/not-here"),
    "no_revision": error("acme/tiny-llama", revision="v2"),
}))
"""


def fill_cache(hub: Path, repo_id: str, source: Path) -> Path:
    """The cache layout huggingface_hub writes: a ref per branch naming a commit, a
    snapshot folder per commit (plain files here, where it links blobs)."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    for branch, commit in COMMITS.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in source.iterdir():
            (snapshot / file.name).write_bytes(file.read_bytes())
    return repo


@pytest.mark.slow
def test_a_cached_model_id_loads_offline_and_a_missing_one_names_the_download(tmp_path):
    repo = fill_cache(tmp_path / "hub", "acme/tiny-llama", checkpoint("llama"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint("llama"))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(got["main"]) == repo / "snapshots" / COMMITS["main"]
    assert Path(got["v1"]) == repo / "snapshots" / COMMITS["v1"]
    assert got["same_weights"] and got["llm_same_tokens"]   # ts.LLM takes an id and a revision too
    for message, command in ((got["not_cached"], "`hf download acme/not-here`"),
                             (got["no_revision"], "`hf download acme/tiny-llama --revision v2`")):
        assert "HF_HUB_OFFLINE" in message and str(tmp_path / "hub") in message and command in message


def test_a_local_path_is_returned_as_it_is(tmp_path, monkeypatch):
    assert resolve_model(checkpoint("llama")) == checkpoint("llama")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    assert resolve_model("acme/tiny") == Path("acme/tiny")          # a folder of that name wins


def test_a_path_from_the_home_folder_resolves_and_loads(tmp_path, monkeypatch):
    """``~/...`` (as ``--model=~/x`` and Python strings pass it, unexpanded by a shell)
    names the home folder's model; a missing one is still refused as written."""
    import tokenspeed as ts
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(checkpoint("llama"))
    assert resolve_model("~/models/tiny") == tmp_path / "models" / "tiny"
    assert ts.models.load("~/models/tiny/").config == ts.models.load(checkpoint("llama")).config
    with pytest.raises(FileNotFoundError, match=r"^~/models/other: no such file or directory"):
        resolve_model("~/models/other")


def test_a_missing_path_that_is_no_model_id_is_refused_by_name():
    for missing in ("./nothing", "/no/such/dir", "model.gguf", "a/b/c"):   # none of them an id
        with pytest.raises(FileNotFoundError, match=f"^{re.escape(missing)}: no such file or directory"):
            resolve_model(missing)


def test_a_revision_of_a_local_path_is_refused():
    with pytest.raises(ValueError, match="revision='v1'.*local path"):
        resolve_model(checkpoint("llama"), revision="v1")


def test_a_revision_without_a_model_is_refused_before_loading():
    """The embedded default model is one file: a revision given with no model names nothing."""
    from tokenspeed.api.model_source import model_path
    from tokenspeed.models.gguf import default_model_path

    with pytest.raises(ValueError, match="revision='v1'.*no model was given"):
        model_path(None, revision="v1")
    assert model_path(None) == default_model_path()


@pytest.mark.parametrize("name, is_id", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("Qwen/Qwen3-0.6B", True), ("meta-llama/Llama-3.2-1B", True),
    ("model.gguf", False), ("owner/model.gguf", False), ("./owner/name", False), ("/abs/path", False),
    ("a/b/c", False), ("gpt2", False),
])
def test_model_ids_are_owner_slash_name(name, is_id):
    assert is_repo_id(name) == is_id


def test_a_download_fetches_the_hugging_face_weights_not_mistral_inferences_copy(monkeypatch):
    """Mistral's repositories hold their weights twice (sharded Hugging Face files and
    ``consolidated.safetensors``); a download fetches what the loader reads, once."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from tokenspeed.models import hub
    repo = ["config.json", "generation_config.json", "consolidated.safetensors", "params.json",
            "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer.model", "tokenizer.model.v3", "tokenizer_config.json", "README.md"]
    asked = {}
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: asked.update(kw) or "/snap")
    assert resolve_model("mistralai/Mistral-7B-Instruct-v0.3") == Path("/snap")
    fetched = set(filter_repo_objects(repo, allow_patterns=asked["allow_patterns"],
                                      ignore_patterns=asked.get("ignore_patterns")))
    assert fetched == {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                       "tokenizer_config.json", *(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))}
