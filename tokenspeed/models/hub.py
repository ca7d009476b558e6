"""Hugging Face model ids ("owner/name") as local checkpoint directories.

Resolved through ``huggingface_hub`` so that its cache, ``HF_HOME``/``HF_HUB_CACHE``,
``HF_HUB_OFFLINE`` and login behave as they do for transformers: a snapshot is taken from
the cache where it is there, else the files tokenspeed reads are downloaded (safetensors
weights, config and tokenizer files; not the PyTorch ``.bin``, GGUF or mistral-inference
``consolidated`` copies a repository may also hold).
"""

import re
from pathlib import Path

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
CHECKPOINT_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json",
                    "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja")
# mistral-inference's copy of the weights, in its own tensor names, which Mistral's
# repositories publish beside the sharded Hugging Face files (Mistral-7B-Instruct-v0.3:
# 14.5 GB more); a repository with no other weights has no config.json to load it by.
SKIPPED_FILES = ("consolidated*.safetensors",)


class ModelNotFoundError(FileNotFoundError):
    """A model id that is neither a local path nor to be had from the Hugging Face Hub."""


def resolve_model(name_or_path, revision: str | None = None) -> Path:
    """The local checkpoint (directory or ``.gguf`` file) that ``name_or_path`` names: a
    path that exists is returned as is (the loader names what is missing in it); an
    ``owner/name`` id is looked up in the cache or downloaded (``ModelNotFoundError`` where
    it is not to be had); anything else is refused here, so that every command says the
    same of a path that is not there. A path starting ``~`` names the home folder, as in a
    shell (where ``--model=~/x`` or a Python string is not expanded), unless a folder
    named ``~`` is there."""
    path = _expanded(Path(name_or_path))
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} selects a version of a Hugging Face model id; "
                             f"{str(name_or_path)!r} is a local path")
        return path
    if not is_repo_id(str(name_or_path)):
        raise FileNotFoundError(f"{name_or_path}: no such file or directory (expected a Hugging Face model "
                                f"directory, a GGUF file or a Hugging Face model id, owner/name)")
    return _snapshot(str(name_or_path), revision)


def _expanded(path: Path) -> Path:
    """``path`` with a leading ``~`` expanded, where the path as written is not there."""
    return path if path.exists() or not str(path).startswith("~") else path.expanduser()


def is_repo_id(name: str) -> bool:
    return REPO_ID.fullmatch(name) is not None and not name.endswith(".gguf")


def download_command(repo_id: str, revision: str | None) -> str:
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def _snapshot(repo_id: str, revision: str | None) -> Path:
    """Imported here: ``huggingface_hub`` takes about half a second to import, paid only
    when a model id is given."""
    import huggingface_hub
    from huggingface_hub import errors

    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                      allow_patterns=list(CHECKPOINT_FILES),
                                                      ignore_patterns=list(SKIPPED_FILES)))
    except errors.LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(_not_cached(repo_id, revision, exc)) from exc
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as exc:
        raise ModelNotFoundError(f"{repo_id!r} is not a local path, and the Hugging Face Hub has no "
                                 f"model by that name that this login may read (for a private or "
                                 f"gated model, log in with `hf auth login`)") from exc
    except errors.RevisionNotFoundError as exc:
        raise ModelNotFoundError(f"model {repo_id!r} has no revision {revision!r} on the Hugging "
                                 f"Face Hub") from exc
    except errors.HFValidationError as exc:
        raise ValueError(f"{repo_id!r} is neither a local path nor a valid Hugging Face model id "
                         f"({exc})") from exc


def _not_cached(repo_id: str, revision: str | None, exc: Exception) -> str:
    from huggingface_hub import constants

    where = f"is not a local path, and not (completely) in the Hugging Face cache {constants.HF_HUB_CACHE}"
    why = ("HF_HUB_OFFLINE is set, so nothing is downloaded" if constants.HF_HUB_OFFLINE
           else f"the Hub could not be reached ({type(exc.__cause__ or exc).__name__})")
    return f"{repo_id!r} {where}; {why}: download it with `{download_command(repo_id, revision)}`"
