"""A checkpoint's own chat template, rendered the way transformers' apply_chat_template does.

Chat models are trained on one exact prompt format; the checkpoint ships it as a Jinja
template (tokenizer_config.json "chat_template", a string or a list of named templates, or
chat_template.jinja beside it). Rendering it with any other environment (no trim_blocks, a
tojson that escapes HTML, no raise_exception) gives prompts the model was never trained on,
so the environment here copies transformers' one. Templates come from model hubs and are
untrusted code: they run in Jinja's immutable sandbox.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bullet_trt.config import load_engine_config

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# Names transformers passes to every template (its special_tokens_map), when the checkpoint has them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A template that cannot be loaded, or messages it refuses (its raise_exception)."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt's text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    return value.get("content") if isinstance(value, dict) else value


def _pick(template: Any, source: Path) -> str | None:
    """The template to use from tokenizer_config.json's "chat_template" value."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        # Like transformers without tools: the one named "default"; a lone template is the default.
        if "default" in named:
            return named["default"]
        if len(named) == 1:
            return next(iter(named.values()))
        raise ChatTemplateError(f"{source} holds named chat templates ({', '.join(map(str, named))}) "
                                "and none is named 'default'")
    raise ChatTemplateError(f"{source}: chat_template must be a string or a list of named templates, "
                            f"got {type(template).__name__}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, origin: str = ""):
        self.source = source
        self.origin = origin  # where it came from, for messages
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template {origin} does not parse: {e}") from e

    @classmethod
    def from_tokenizer_dir(cls, root: str | Path, template_file: str | Path | None = None) -> "ChatTemplate | None":
        """The template in a checkpoint's tokenizer files, or None when it has none;
        `template_file` replaces it (see from_file) and still gets the checkpoint's bos_token,
        eos_token, ... for the variables of those names."""
        root = Path(root)
        cfg = _read_json(root / CONFIG_FILE) if (root / CONFIG_FILE).is_file() else {}
        tokens = {name: _token_text(cfg.get(name)) for name in SPECIAL_TOKENS}
        if template_file is not None:
            return cls.from_file(template_file, tokens)
        # transformers lets chat_template.jinja win over the copy in tokenizer_config.json.
        if (root / TEMPLATE_FILE).is_file():
            return cls((root / TEMPLATE_FILE).read_text(encoding="utf-8"), tokens, str(root / TEMPLATE_FILE))
        source = _pick(cfg.get("chat_template"), root / CONFIG_FILE)
        return cls(source, tokens, str(root / CONFIG_FILE)) if source else None

    @classmethod
    def from_engine(cls, engine_dir: str | Path, template_file: str | Path | None = None) -> "ChatTemplate | None":
        """The template of the checkpoint an engine directory serves (engine.yaml's tokenizer),
        or `template_file` in its place."""
        path = load_engine_config(engine_dir).tokenizer_path
        return cls.from_tokenizer_dir(path.parent if path.name.endswith(".json") else path, template_file)

    @classmethod
    def from_file(cls, path: str | Path, special_tokens: Mapping[str, str] | None = None) -> "ChatTemplate":
        """A template of one's own: a Jinja file, or a JSON file with a "chat_template" key (a
        tokenizer_config.json). `special_tokens` (bos_token, eos_token, ...) fill the template's
        variables of those names; a tokenizer_config.json brings its own."""
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if path.suffix == ".json":
            cfg = _read_json(path)
            source = _pick(cfg.get("chat_template"), path)
            if not source:
                raise ChatTemplateError(f"{path} has no chat_template")
            tokens.update({n: _token_text(cfg[n]) for n in SPECIAL_TOKENS if cfg.get(n) is not None})
            return cls(source, tokens, str(path))
        return cls(text, tokens, str(path))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text for `messages` ({"role", "content", ...} dicts); extra keyword
        arguments are template variables, as apply_chat_template passes them."""
        # As transformers does: keys set to None are dropped, since many templates test for a
        # key's presence and would print "None".
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            # tools and documents are always defined, as None, because apply_chat_template
            # defines them and templates test `tools is not none`.
            return self._template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                         **{"tools": None, "documents": None, **self.special_tokens, **kwargs})
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
