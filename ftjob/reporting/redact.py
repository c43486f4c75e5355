"""Secrets stay secret: what ftjob writes (summary.json, the config kept in every checkpoint,
logger params, Hydra's ``.hydra/`` files) and prints (the resume command, progress lines)
never holds a credential.

A value is secret when its key names one (``key``, ``secret``, ``token``, ``password``,
``credentials``, ``*_key``, ``*_token``, ...), when it is an environment variable handed to
the workers (``ray.runtime_env.env_vars``), or when it came from the environment
(``${oc.env:...}``: it is written as that interpolation, which says where it comes from).
Passwords in URLs (``https://user:pw@host``) and secret-named query parameters are cut from
any string. Text (console lines, error messages) is scrubbed of every secret value seen.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

REDACTED = "<redacted>"
_SECRET_KEY = re.compile(
    r"(^|[_-])(key|secret|token|password|passwd|pwd|credentials?|connection_string|"
    r"signature|sig|sas)$|secret|password",
    re.IGNORECASE,
)
_ENV_SECTIONS = ("ray.runtime_env.env_vars",)
_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^\s'\"]+", re.IGNORECASE)
_ENV_INTERPOLATION = re.compile(r"\$\{(oc\.env|env):")
_PAIR = re.compile(r"[+~]*[\w.]+=[^,]*")
_SHORTEST_SCRUBBED = 8  # shorter values would scrub ordinary words ("offline") from text


def is_secret_key(key: str) -> bool:
    """Does the last part of a dotted key name a credential?"""
    return bool(_SECRET_KEY.search(str(key).rsplit(".", 1)[-1]))


def _secret_path(path: str) -> bool:
    return is_secret_key(path) or any(path.startswith(s + ".") for s in _ENV_SECTIONS)


def redact_url(text: str) -> str:
    """``text`` with URL passwords and secret-named query parameters replaced."""

    def one(match: re.Match[str]) -> str:
        url = match.group(0)
        try:
            parts = urlsplit(url)
        except ValueError:
            return url
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:{REDACTED}@{host}" if ":" in userinfo else f"{REDACTED}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(is_secret_key(k) for k, _ in pairs):
                query = urlencode([(k, REDACTED if is_secret_key(k) else v) for k, v in pairs])
        if (netloc, query) == (parts.netloc, parts.query):
            return url
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))

    return _URL.sub(one, text)


def env_sources(raw: Any, prefix: str = "") -> dict[str, str]:
    """Dotted key -> the ``${oc.env:...}`` text of every value in an unresolved config that
    comes from the environment."""
    out: dict[str, str] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            out.update(env_sources(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(raw, list):
        for i, v in enumerate(raw):
            out.update(env_sources(v, f"{prefix}.{i}"))
    elif isinstance(raw, str) and _ENV_INTERPOLATION.search(raw):
        out[prefix] = raw
    return out


class Redactor:
    """Redacts configs, Hydra overrides and text. ``env`` (from :func:`env_sources`) says
    which keys came from the environment; ``resolved`` (the resolved config) gives the values
    to scrub from text."""

    def __init__(self, env: dict[str, str] | None = None, resolved: Any = None) -> None:
        self.env = dict(env or {})
        self.values: set[str] = set()
        if resolved is not None:
            self._collect(resolved, "")

    def _collect(self, node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                self._collect(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                self._collect(v, f"{path}.{i}")
        elif node is not None and not isinstance(node, bool):
            text = str(node)
            if _secret_path(path):
                self.add(text)
            for match in _URL.finditer(text):
                userinfo = urlsplit(match.group(0)).netloc.rpartition("@")[0]
                if ":" in userinfo:
                    self.add(userinfo.split(":", 1)[1])

    def add(self, value: str) -> None:
        if len(value) >= _SHORTEST_SCRUBBED:
            self.values.add(value)

    def config(self, node: Any, path: str = "") -> Any:
        """A copy of a plain config with every secret value replaced."""
        if path in self.env:
            return self.env[path]
        if isinstance(node, dict):
            return {k: self.config(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [self.config(v, f"{path}.{i}") for i, v in enumerate(node)]
        if node is not None and not isinstance(node, bool) and _secret_path(path):
            return REDACTED
        if isinstance(node, str):
            return self.text(node)
        return node

    def text(self, text: str) -> str:
        """``text`` without any secret value seen, URL password or secret query parameter."""
        for value in sorted(self.values, key=len, reverse=True):
            text = text.replace(value, REDACTED)
        return redact_url(text)

    def override(self, override: str) -> tuple[str, str | None]:
        """A Hydra override (``key=value``) safe to print, and when its value had to go, a
        note of where the printed command takes it from (an environment variable)."""
        key, sep, value = override.partition("=")
        bare = key.lstrip("+~")
        if not sep or _ENV_INTERPOLATION.search(value) or not _secret_path(bare):
            return self.text(override), None
        variable = "FTJOB_" + re.sub(r"[^A-Za-z0-9]", "_", bare).upper()
        return (
            f"{key}=${{oc.env:{variable}}}",
            f"{bare} is read from ${variable} in this command: export it first",
        )

    def overrides(self, overrides: Iterable[str]) -> list[str]:
        return [self.override(o)[0] for o in overrides]

    def hydra(self, node: Any, key: str = "") -> Any:
        """Hydra's own record of a job (``.hydra/hydra.yaml``): its override lists and the
        ``override_dirname`` made of them, and every other string as text."""
        if isinstance(node, dict):
            return {k: self.hydra(v, str(k)) for k, v in node.items()}
        if isinstance(node, list):
            if key in ("task", "hydra") and all(isinstance(v, str) for v in node):
                return self.overrides(node)
            return [self.hydra(v) for v in node]
        if isinstance(node, str) and key == "override_dirname":
            return _PAIR.sub(lambda m: self.override(m.group(0))[0], node)
        return self.text(node) if isinstance(node, str) else node


def redactor_for(cfg: DictConfig) -> Redactor:
    """The secrets of a job's config (without its ``hydra`` node): by key, and where they
    came from the environment."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:  # the config error itself is reported where it is loaded
        resolved = raw
    return Redactor(env_sources(raw), resolved)


def redact_yaml(path: str, redactor: Redactor) -> None:
    """Rewrite one of Hydra's records (``.hydra/config.yaml``, ``overrides.yaml``,
    ``hydra.yaml``, a sweep's ``multirun.yaml``) without its secrets; values from the
    environment stay interpolations."""
    content = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if isinstance(content, list):  # overrides.yaml
        content = redactor.overrides(content)
    elif isinstance(content, dict):
        hydra = content.pop("hydra", None)
        content = redactor.config(content)
        if hydra is not None:
            content = {"hydra": redactor.hydra(hydra), **content}
    OmegaConf.save(OmegaConf.create(content), path)


def redact_hydra_files(run_dir: str, subdir: str | None, redactor: Redactor) -> None:
    """Hydra wrote the composed config and the overrides into the run dir before the job
    started: rewrite them without their secrets."""
    if not subdir:
        return
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        path = os.path.join(run_dir, subdir, name)
        if os.path.isfile(path):
            redact_yaml(path, redactor)
