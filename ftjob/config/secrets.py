"""Secrets stay secret: what ftjob writes (summary.json, the config kept in every checkpoint,
logger params, Hydra's ``.hydra/`` files, a sweep's ``multirun.yaml``) and prints (the resume
command, progress lines, config errors, log records) never holds a credential.

A value is secret when a key on its path names one, in any spelling (``key``, ``secret``,
``token``, ``password``, ``passphrase``, ``credentials``, ``SessionToken``, ``apiKey``,
``sasToken``, ``Authorization``, ``Cookie``, ``*_key``, plurals such as ``tokens``, short
ones such as ``pass``): everything under such a key -- a whole dict or list -- is secret, and
so is a value named beside it (:func:`secret_pair`: a header as ``[Authorization, '...']`` or
``{name: ..., value: ...}``). So is every environment variable handed to the workers
(``ray.runtime_env.env_vars``) or set for the job by Hydra (``hydra.job.env_set``). A value
that came from the environment (``${oc.env:...}``) is written as that interpolation, which
says where it comes from. Passwords in URLs (``https://user:pw@host``), secret-named query
parameters and ``secret_key=value`` pairs are cut from any string.

Text (console lines, error messages, log records) is also scrubbed of every secret value
seen, by length: a value of 8 characters or more wherever it appears; one of 3 to 7 where it
stands as a whole token (not inside a longer run of letters and digits: "hunter2" is cut from
"password hunter2 rejected", "abc" is not cut from "abcdef"); a value of 1 or 2 characters is
not scrubbed from free text -- it protects nothing, and cutting every "a" would mangle each
line and give the value away by the pattern of the cuts. Such values are still redacted by
key in configs, overrides and ``key=value`` pairs, and in URLs. An environment variable whose
name is not a credential's (``WANDB_MODE: offline``) is redacted where written but scrubbed
from text only from 8 characters: shorter values there are ordinary words.
"""

from __future__ import annotations

import logging
import os
import re
import traceback
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

REDACTED = "<redacted>"
# A key is split into lower-case words (camelCase, ``_``, ``-``, ``.``): it names a secret
# when its last word is one of these, when any word is one of the unambiguous ones, or when
# its words run together into one of the compounds (``apikey``, ``sessiontoken``).
_LAST_WORDS = frozenset(
    "key secret token password passwd pwd pass pw passphrase credential credentials signature sig "
    "sas auth authorization cookie cookies bearer".split()
)
_ANY_WORDS = frozenset(
    "secret secrets password passwd passphrase credential credentials authorization".split()
)
_COMPOUNDS = tuple(
    "apikey accesskey secretkey privatekey accountkey masterkey accesskeyid sessiontoken "
    "accesstoken refreshtoken authtoken idtoken sastoken securitytoken bearertoken "
    "clientsecret connectionstring password passphrase secret token credentials cookie "
    "authorization signature".split()
)
_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
_ENV_SECTIONS = ("ray.runtime_env.env_vars",)
_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^\s'\"]+", re.IGNORECASE)
_ENV_INTERPOLATION = re.compile(r"\$\{(oc\.env|env):")
# Hydra joins ``override_dirname`` with commas; a comma inside a list or dict value is not
# followed by another ``key=``.
_DIRNAME_SEP = re.compile(r",(?=[+~]*[\w./-]+=)")
# ``key=value``, ``key='value'``, ``"key": "value"``, ``key: 'value'`` in free text (an
# unquoted value after a colon is prose: "token: expired").
_TEXT_PAIR = re.compile(
    r"""(?P<key>['"]?[A-Za-z_][\w.+~-]*['"]?)"""
    r"""(?P<sep>\s*=\s*|\s*:\s*(?=['"]))"""
    r"""(?P<value>'[^']*'|"[^"]*"|(?:(?:Bearer|Basic|Token|Digest)\s+)?[^\s,;&'"}\])]+)""",
    re.IGNORECASE,
)
_STRUCTURED_KEY = re.compile(r"""([A-Za-z_][\w-]*|'[^']*'|"[^"]*")\s*:(?!//)""")
SCRUBBED_ANYWHERE = 8  # a value this long is cut wherever it appears in text
SCRUBBED_AS_TOKEN = 3  # shorter ones (down to this) only where they stand as a whole token


def _words(key: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(key)]


def is_secret_key(key: str) -> bool:
    """Does the last part of a dotted key name a credential (in any case or spelling, plurals
    too: ``tokens``, ``api_keys``; a bare ``keys`` is a list of names)?"""
    words = _words(str(key).rsplit(".", 1)[-1])
    if not words:
        return False
    joined, last = "".join(words), words[-1]
    plural = last.endswith("s") and (last[:-1] in _LAST_WORDS) and words != ["keys"]
    return (
        last in _LAST_WORDS
        or plural
        or any(w in _ANY_WORDS for w in words)
        or joined.endswith(_COMPOUNDS)
        or joined.endswith(tuple(c + "s" for c in _COMPOUNDS))
    )


def secret_pair(node: Any) -> tuple[str, Any] | None:
    """``(name, value)`` where ``node`` holds a credential by naming it beside its value rather
    than under it: a pair ``[Authorization, 'Bearer ...']`` (HTTP headers given as a list of
    pairs, as aiohttp takes them) or ``{name: Authorization, value: ...}``; else None."""
    if isinstance(node, list | tuple) and len(node) == 2 and isinstance(node[0], str):
        name, value = node
    elif isinstance(node, dict) and set(node) == {"name", "value"}:
        name, value = node["name"], node["value"]
    else:
        return None
    return (name, value) if isinstance(name, str) and is_secret_key(name) else None


def names_secret(path: str) -> bool:
    """Is a dotted key, or a key above it, named for a credential?"""
    return any(is_secret_key(part) for part in str(path).lstrip("+~").split("."))


def is_secret_path(path: str) -> bool:
    """Is a dotted key secret itself or under a secret key, or an environment variable?"""
    return names_secret(path) or any(path.startswith(s + ".") for s in _ENV_SECTIONS)


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


def redact_pairs(text: str) -> str:
    """``text`` with the value of every secret-named ``key=value`` (or quoted ``key: 'value'``)
    replaced; a value read from the environment (``${oc.env:...}``) is kept."""

    def one(match: re.Match[str]) -> str:
        key = match.group("key").strip("'\"")
        value = match.group("value")
        inner = value.strip("'\"")
        if not is_secret_path(key) or not any(c.isalnum() for c in inner):
            return match.group(0)  # a shell's quoting ('"'"'), not a value
        if inner.startswith("${") or REDACTED in value:
            return match.group(0)
        quote = value[0] if value[:1] in "'\"" else ""
        return f"{match.group('key')}{match.group('sep')}{quote}{REDACTED}{quote}"

    return _TEXT_PAIR.sub(one, text)


def holds_secret_key(value: str) -> bool:
    """Does a structured override value (``{headers: {Authorization: ...}}``) name a secret?"""
    return value.lstrip()[:1] in ("{", "[") and any(
        is_secret_key(k.strip("'\"")) for k in _STRUCTURED_KEY.findall(value)
    )


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


def _token_pattern(value: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])")


class Redactor:
    """Redacts configs, Hydra overrides and text. ``env`` (from :func:`env_sources`) says
    which keys came from the environment; ``resolved`` (the resolved config) gives the values
    to scrub from text."""

    def __init__(self, env: dict[str, str] | None = None, resolved: Any = None) -> None:
        self.env = dict(env or {})
        self.values: set[str] = set()
        self._tokens: dict[str, re.Pattern[str]] = {}
        if resolved is not None:
            self._collect(resolved, "")

    @classmethod
    def for_overrides(cls, overrides: Iterable[str]) -> Redactor:
        """The secrets a command line gives (before any config is composed)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException

        redactor = cls()
        parser = OverridesParser.create()
        for override in overrides:
            try:
                parsed = parser.parse_override(override)
            except HydraException:  # not an override Hydra reads: its text only
                key, _, text = override.partition("=")
                if is_secret_path(key):
                    redactor.add(text.strip("'\""))
                continue
            value = parsed.value()
            values = getattr(value, "list", None) if parsed.is_sweep_override() else [value]
            for one in values or []:
                redactor._collect(one, parsed.key_or_group)
        return redactor

    def _collect(self, node: Any, path: str) -> None:
        pair = secret_pair(node)
        if pair is not None:  # collected as if under its name: a secret path
            self._collect(pair[1], f"{path}.{pair[0]}" if path else pair[0])
            return
        if isinstance(node, dict):
            for k, v in node.items():
                self._collect(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                self._collect(v, f"{path}.{i}")
        elif node is not None and not isinstance(node, bool):
            text = str(node)
            if is_secret_path(path) and not _ENV_INTERPOLATION.search(text):
                self.add(text, short=names_secret(path))
            for match in _URL.finditer(text):
                userinfo = urlsplit(match.group(0)).netloc.rpartition("@")[0]
                if ":" in userinfo:
                    self.add(userinfo.split(":", 1)[1])

    def add(self, value: str, short: bool = True) -> None:
        """A secret value to scrub from text (see the module's note on short values).
        ``short=False``: a value that is secret only for where it is (an environment
        variable not named for a credential, ``WANDB_MODE: offline``) is scrubbed only from
        8 characters: shorter ones are ordinary words."""
        if len(value) >= SCRUBBED_ANYWHERE:
            self.values.add(value)
        elif short and len(value) >= SCRUBBED_AS_TOKEN and value != REDACTED:
            self._tokens[value] = _token_pattern(value)

    def joined(self, other: Redactor) -> Redactor:
        """A redactor that scrubs from text every value either one does."""
        both = Redactor({**self.env, **other.env})
        both.values = self.values | other.values
        both._tokens = {**self._tokens, **other._tokens}
        return both

    def add_env(self, variables: dict[str, Any]) -> None:
        """Environment variables set for the job: all redacted where written; scrubbed from
        text as :meth:`add` says, by whether the name is a credential's."""
        for name, value in variables.items():
            if value is not None and not isinstance(value, bool):
                self.add(str(value), short=is_secret_key(str(name)))

    def config(self, node: Any, path: str = "") -> Any:
        """A copy of a plain config with every secret value (and everything under a secret
        key) replaced."""
        if path in self.env:
            return self.env[path]
        pair = secret_pair(node)
        if pair is not None:
            value = self.config(pair[1], f"{path}.{pair[0]}" if path else pair[0])
            if isinstance(node, dict):
                return {"name": pair[0], "value": value}
            return [pair[0], value]
        if isinstance(node, dict):
            return {k: self.config(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [self.config(v, f"{path}.{i}") for i, v in enumerate(node)]
        if node is not None and not isinstance(node, bool) and is_secret_path(path):
            return REDACTED
        if isinstance(node, str):
            return self.text(node)
        return node

    def holds(self, text: str) -> bool:
        """Does ``text`` hold a secret value seen (a header's value in a list of pairs, say) --
        one long enough to be told apart from an ordinary word (:data:`SCRUBBED_ANYWHERE`)?"""
        return any(value in text for value in self.values)

    def text(self, text: str) -> str:
        """``text`` without any secret value seen, URL password, secret query parameter or
        secret ``key=value`` pair."""
        for value in sorted(self.values, key=len, reverse=True):
            text = text.replace(value, REDACTED)
        for value in sorted(self._tokens, key=len, reverse=True):
            text = self._tokens[value].sub(REDACTED, text)
        return redact_url(redact_pairs(text))

    def binary(self, data: bytes) -> bytes:
        """A binary file's bytes without any secret value seen (its UTF-8 bytes), for files
        that cannot be scrubbed as text (TensorBoard's events): a secret never leaves, at the
        price of the record that held it."""
        for value in sorted(self.values, key=len, reverse=True):
            data = data.replace(value.encode(), REDACTED.encode())
        for value in sorted(self._tokens, key=len, reverse=True):
            token = rb"(?<![A-Za-z0-9])" + re.escape(value.encode()) + rb"(?![A-Za-z0-9])"
            data = re.sub(token, REDACTED.encode(), data)
        return data

    def strings(self, node: Any) -> Any:
        """A copy of a JSON-like record (summary.json) with every string scrubbed as text."""
        if isinstance(node, dict):
            return {k: self.strings(v) for k, v in node.items()}
        if isinstance(node, list):
            return [self.strings(v) for v in node]
        return self.text(node) if isinstance(node, str) else node

    def override(self, override: str) -> tuple[str, str | None]:
        """A Hydra override (``key=value``) safe to print, and when its value had to go, a
        note of where the printed command takes it from (an environment variable; a dict or
        list is decoded from it)."""
        key, sep, value = override.partition("=")
        bare = key.lstrip("+~")
        if not sep or _ENV_INTERPOLATION.search(value):
            return self.text(override), None
        if not is_secret_path(bare) and not holds_secret_key(value) and not self.holds(value):
            return self.text(override), None
        variable = "FTJOB_" + re.sub(r"[^A-Za-z0-9]", "_", bare).upper()
        structured = value.lstrip()[:1] in ("{", "[")
        source = f"${{oc.env:{variable}}}"
        return (
            # quoted: Hydra's override grammar takes no nested interpolation unquoted
            f"{key}='${{oc.decode:{source}}}'" if structured else f"{key}={source}",
            f"{bare} is read from ${variable} in this command: export it first",
        )

    def overrides(self, overrides: Iterable[str]) -> list[str]:
        return [self.override(o)[0] for o in overrides]

    def hydra(self, node: Any, key: str = "") -> Any:
        """Hydra's own record of a job (``.hydra/hydra.yaml``): its override lists and the
        ``override_dirname`` made of them, the variables it sets for the job
        (``job.env_set``), secret-named keys (a sweeper's params), and every other string as
        text."""
        if isinstance(node, dict):
            if key == "env_set":
                return {k: REDACTED if v is not None else v for k, v in node.items()}
            return {
                k: self.config(v, str(k)) if is_secret_path(str(k)) else self.hydra(v, str(k))
                for k, v in node.items()
            }
        if isinstance(node, list):
            if key in ("task", "hydra") and all(isinstance(v, str) for v in node):
                return self.overrides(node)
            return [self.hydra(v) for v in node]
        if isinstance(node, str) and key == "override_dirname":
            return ",".join(self.override(part)[0] for part in _DIRNAME_SEP.split(node))
        return self.text(node) if isinstance(node, str) else node


def redactor_for(cfg: DictConfig, env_set: Any = None) -> Redactor:
    """The secrets of a job's config (without its ``hydra`` node): by key, and where they
    came from the environment; plus the values of ``env_set`` (``hydra.job.env_set``)."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:  # the config error itself is reported where it is loaded
        resolved = raw
    redactor = Redactor(env_sources(raw), resolved)
    if env_set:
        redactor.add_env(dict(env_set))
    return redactor


def redact_yaml(path: str, redactor: Redactor) -> None:
    """Rewrite one of Hydra's records (``.hydra/config.yaml``, ``overrides.yaml``,
    ``hydra.yaml``, a sweep's ``multirun.yaml``) without its secrets; values from the
    environment stay interpolations."""
    loaded = OmegaConf.load(path)
    content = OmegaConf.to_container(loaded, resolve=False)
    if isinstance(content, list):  # overrides.yaml
        content = redactor.overrides(content)
    elif isinstance(content, dict):
        hydra = content.pop("hydra", None)
        content = redactor.config(content)
        if hydra is not None:
            content = {"hydra": redactor.hydra(hydra), **content}
    redacted = OmegaConf.to_yaml(OmegaConf.create(content))
    if redacted == OmegaConf.to_yaml(loaded):
        return  # already without secrets (a sweep's jobs each redact multirun.yaml)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        f.write(redacted)
    os.replace(partial, path)  # a reader (another job, the sweep report) sees old or new


def redact_hydra_files(run_dir: str, subdir: str | None, redactor: Redactor) -> None:
    """Hydra wrote the composed config and the overrides into the run dir before the job
    started: rewrite them without their secrets."""
    if not subdir:
        return
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        path = os.path.join(run_dir, subdir, name)
        if os.path.isfile(path):
            redact_yaml(path, redactor)


class SecretFilter(logging.Filter):
    """A log record without secrets: its message (formatted) and its traceback scrubbed as
    :meth:`Redactor.text` does. Passes every record."""

    def __init__(self, redactor: Redactor | None = None) -> None:
        super().__init__()
        self.redactor = redactor or Redactor()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format: logging reports it itself
            return True
        record.msg, record.args = self.redactor.text(message), None
        if record.exc_info and not record.exc_text:
            trace = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            record.exc_text = self.redactor.text(trace)
        if record.stack_info:
            record.stack_info = self.redactor.text(record.stack_info)
        return True


_GUARD = SecretFilter()


def guard_logging(redactor: Redactor) -> None:
    """Every log record this process makes from now on passes :class:`SecretFilter` with
    ``redactor``'s secrets (a later call replaces them). It is applied where records are
    made, not on handlers: Hydra replaces the handlers (``hydra_logging``, then each job's
    ``job_logging``) after ftjob's entry point runs, and a launcher logs the sweep's
    overrides before any job starts. Values accumulate: a later call (the next job of a
    sweep) adds its secrets to those already scrubbed, never drops them."""
    _GUARD.redactor = _GUARD.redactor.joined(redactor)
    make = logging.getLogRecordFactory()
    if getattr(make, "ftjob_guard", False):
        return

    def guarded(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        _GUARD.filter(record)
        return record

    guarded.ftjob_guard = True  # type: ignore[attr-defined]  # a mark on the function object
    logging.setLogRecordFactory(guarded)
