"""Model answers kept on disk: an unchanged request is answered again without asking the model.

A key is the SHA-256 of everything a role sent (the model's name, the schema, the messages: the prompt and
the case included), in canonical JSON; an entry is ``DIR/ab/abcdef....json`` holding the answer and the model's name,
written to a temporary file and renamed, so a crash leaves no half-written entry.  No key, header or
environment value is ever written.  A cache that cannot be read or written is passed by (the model is
asked), never an error: it only saves time.

The default directory is ``$PIPELINES_PORT_CACHE``, else ``$XDG_CACHE_HOME/pipelines-port``, else
``~/.cache/pipelines-port``; ``--model-cache DIR`` and ``--no-model-cache`` choose per run.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from typing import Any, Dict, Mapping, Optional

__all__ = ["AnswerCache", "default_directory"]

VERSION = 1


def default_directory() -> str:
    """Where answers are kept unless a run says otherwise."""
    explicit = os.environ.get("PIPELINES_PORT_CACHE", "").strip()
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pipelines-port")


class AnswerCache:
    """A directory of answers by request hash; ``hits`` and ``writes`` count this run's use of it."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.join(directory, f"answers-v{VERSION}")
        self.hits = self.writes = 0
        self.problem: Optional[str] = None  # the first reason the cache could not be used, for the report
        self._lock = threading.Lock()

    @staticmethod
    def key(request: Mapping[str, Any]) -> str:
        canonical = json.dumps(request, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], key + ".json")

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        try:
            with open(self._path(key), encoding="utf-8") as f:
                entry = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._note(f"cannot read {self._path(key)}: {exc}")
            return None
        if not isinstance(entry, dict):
            return None
        with self._lock:
            self.hits += 1
        return entry

    def put(self, key: str, entry: Mapping[str, Any]) -> None:
        path = self._path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(dict(entry), f, ensure_ascii=False, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            self._note(f"cannot write {path}: {exc.strerror or exc}")
            return
        with self._lock:
            self.writes += 1

    def _note(self, problem: str) -> None:
        with self._lock:
            self.problem = self.problem or problem
